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


def test_the_tools_have_no_import_circle():
    """Every import in s3flow_tools (at module level or inside a function) read from the source: no module reaches
    itself again (issue 49: the admission and scheduling drivers imported each other)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "tools"
    names = {".".join(p.relative_to(root).with_suffix("").parts): p for p in root.rglob("s3flow_tools/**/*.py")}
    names = {n.removesuffix(".__init__"): p for n, p in names.items()}
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {m for m in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if m in names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in names}
        graph[name] = found - {name}

    def reaches(start, seen=None):
        seen = set() if seen is None else seen
        for nxt in graph[start]:
            if nxt not in seen:
                seen.add(nxt)
                reaches(nxt, seen)
        return seen

    circles = sorted(n for n in graph if n in reaches(n) and not n.endswith(("__init__",)))
    assert "s3flow_tools.measure.qos" in graph and graph["s3flow_tools.measure.admission"], "the graph was read"
    assert not circles, f"modules that import themselves through others: {circles}"
