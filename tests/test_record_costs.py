"""What a chunk costs on the shared records (issue 49's count, results/syscalls.md): each reader reads only as fresh
as it needs, each writer writes only what changed, and nothing a fresh reader needs is ever stale."""
from __future__ import annotations

import time

from s3flow.engine.capacity import CapacityModel, Work
from s3flow.serving import draining
from s3flow.serving.load import InstanceLoad, LoadBoard


def test_whether_the_server_closes_is_looked_at_when_the_drain_file_changes_and_a_mark_is_seen_at_once(
        tmp_path, monkeypatch):
    path, looked = tmp_path / "drain", []
    real = draining.pathlib.Path.read_text
    monkeypatch.setattr(draining.pathlib.Path, "read_text", lambda self: looked.append(self) or real(self))
    draining.mark_draining(str(path))
    probe = draining.closing_probe(str(path))
    assert isinstance(probe, draining.FolderWatch), "the kernel watches the file's folder (Linux)"
    (tmp_path / "other").write_text("x")   # another file in the folder: no look
    time.sleep(0.2)
    assert [probe() for _ in range(50)] == [False] * 50 and len(looked) == 1, "looked at once, not per question"
    draining.mark_closing(str(path))
    t0 = time.monotonic()
    while not probe():
        assert time.monotonic() - t0 < 2.0, "the closing mark was not seen"
        time.sleep(0.01)
    assert len(looked) == 2, "looked at again once, when the file changed"
    assert draining.draining_probe(str(path))(), "whether it drains: looked at every time (asked at STARTs only)"


def test_without_a_watch_the_closing_mark_is_looked_at_once_per_period(tmp_path, monkeypatch):
    path = tmp_path / "drain"
    monkeypatch.setattr(draining, "FolderWatch", lambda *args: (_ for _ in ()).throw(OSError("no inotify")))
    probe = draining.closing_probe(str(path), every_s=60.0)
    assert not probe()
    draining.mark_closing(str(path))
    assert not probe(), "(its period is not over)"
    assert draining.closing_probe(str(path), every_s=0.0)(), "a probe whose period is over sees the mark"


def test_a_reader_that_may_be_stale_reads_the_reports_once_per_period_and_admission_always_afresh(tmp_path):
    files = LoadBoard(tmp_path / "load")
    writer = InstanceLoad(files, "vocoder_0", "vocoder", CapacityModel(max_batch=1, duty_prior=None))
    writer.publish({})
    cached = LoadBoard(tmp_path / "load")
    assert cached.read(60.0).reports[0].streams == {}
    writer.publish({3: Work(row_frames=10.0, steps=1, chunks=1, frames=20)})
    assert cached.read(60.0).reports[0].streams == {}, "within its period: what it read"
    assert 3 in cached.read().reports[0].streams, "admission's read (no period) sees the last report"


def test_the_syscall_count_names_records_by_path_and_by_descriptor_and_leaves_the_stubs_server_watch_out():
    """``s3flow_tools.measure.syscalls.count`` over ``strace -f -y`` lines (results/syscalls.md's figure)."""
    from s3flow_tools.measure.syscalls import count

    trace = "\n".join([
        '101 openat(AT_FDCWD, "/dev/shm/s3flow-load-77/cfm_solver_0", O_RDONLY) = 5',
        '101 flock(6</dev/shm/s3flow-seen-77/marks>, LOCK_EX) = 0',
        '102 read(4<anon_inode:inotify>, "...", 4096) = 32',
        '102 newfstatat(AT_FDCWD, "/tmp/s3flow-drain-x/draining", 0x7ffc, 0) = -1 ENOENT',
        '103 kill(555, 0) = 0',     # a reader asks whether a record's writer lives
        '103 kill(77, 0) = 0',      # a stub asks whether its server lives: Triton's, not ours
        '103 openat(AT_FDCWD, "/usr/lib/libfoo.so", O_RDONLY) = 3',
    ])
    assert count(trace, server_pid=77) == {("openat", "load"): 1, ("flock", "seen"): 1, ("read", "drain"): 1,
                                           ("newfstatat", "drain"): 1, ("kill", "a writer alive?"): 1}
