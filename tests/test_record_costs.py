"""What a chunk costs on the shared records (issue 49's count, results/syscalls.md): each reader reads only as fresh
as it needs, each writer writes only what changed, and nothing a fresh reader needs is ever stale."""
from __future__ import annotations

from s3flow.engine.capacity import CapacityModel, Work
from s3flow.serving import draining
from s3flow.serving.arrivals import ArrivalMarks
from s3flow.serving.load import InstanceLoad, LoadFiles


def test_whether_the_server_closes_is_looked_at_once_per_period_and_a_mark_is_seen_within_it(tmp_path, monkeypatch):
    path, looked = tmp_path / "drain", []
    real = draining.pathlib.Path.read_text
    monkeypatch.setattr(draining.pathlib.Path, "read_text", lambda self: looked.append(self) or real(self))
    draining.mark_draining(str(path))
    probe = draining.closing_probe(str(path), every_s=60.0)
    assert [probe() for _ in range(50)] == [False] * 50 and len(looked) == 1, "one look a period"
    draining.mark_closing(str(path))
    assert draining.closing_probe(str(path), every_s=0.0)(), "a probe whose period is over sees the mark"
    assert not probe(), "(this one's period is not over)"
    assert draining.draining_probe(str(path))(), "whether it drains: looked at every time (asked at STARTs only)"


def test_a_sole_writer_counts_in_memory_and_goes_on_from_the_file_after_a_restart(tmp_path):
    folder = tmp_path / "seen"
    shared, sole = ArrivalMarks(folder), ArrivalMarks(folder, shared=False)
    assert [sole.count(7, start=k == 0) for k in range(3)] == [1, 2, 3]
    assert shared.counted(7)[0] == 3, "the readers in other processes see every count"
    assert ArrivalMarks(folder, shared=False).count(7, start=False) == 4, "a reloaded stub goes on from the file"
    assert sole.count(7, start=True) == 1, "a START counts from 1 again"
    assert not (folder / ".lock").exists(), "a sole writer takes no lock"


def test_a_reader_that_may_be_stale_reads_the_reports_once_per_period_and_admission_always_afresh(tmp_path):
    files = LoadFiles(tmp_path / "load")
    writer = InstanceLoad(files, "vocoder_0", "vocoder", CapacityModel(max_batch=1, duty_prior=None))
    writer.publish({})
    cached = LoadFiles(tmp_path / "load")
    assert cached.read(60.0).reports[0].streams == {}
    writer.publish({3: Work(row_frames=10.0, steps=1, chunks=1, frames=20)})
    assert cached.read(60.0).reports[0].streams == {}, "within its period: what it read"
    assert 3 in cached.read().reports[0].streams, "admission's read (no period) sees the last report"
