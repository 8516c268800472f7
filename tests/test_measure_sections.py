"""The measure drivers' shared results files (s3flow_tools.measure.sections): the scheduling driver rewrites
results/qos.md's own part and keeps the admission driver's section; the admission driver replaces its section in
place; neither imports the other."""
from s3flow_tools.measure.sections import markers, write_keeping_sections, write_section


def test_each_driver_rewrites_its_own_part_and_keeps_the_others(tmp_path):
    out = tmp_path / "qos.md"
    write_keeping_sections(out, ["# scheduling", "table 1"])
    write_section(out, "admission", ["## admission", "run 1"])
    write_keeping_sections(out, ["# scheduling", "table 2"])
    text = out.read_text()
    begin, end = markers("admission")
    assert text.startswith("# scheduling\ntable 2\n") and "table 1" not in text
    assert text.count(begin) == 1 and "run 1" in text
    write_section(out, "admission", ["## admission", "run 2"])
    text = out.read_text()
    assert "run 1" not in text and "run 2" in text and "table 2" in text and text.count(end) == 1
