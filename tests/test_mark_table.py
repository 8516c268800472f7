"""The per-sequence marks between a server's processes (``s3flow.serving.mark_table``): one shared-memory table per
kind, a lane per writer process, read and written without a system call once a process has its lane."""
from __future__ import annotations

import builtins
import multiprocessing
import os

import pytest

from s3flow.serving import mark_table
from s3flow.serving.arrivals import ArrivalMarks
from s3flow.serving.mark_table import LANES, SLOTS, MarkTable


def _in_another_process(target, *args) -> None:
    p = multiprocessing.get_context("fork").Process(target=target, args=args)
    p.start()
    p.join(30)
    assert p.exitcode == 0


def _count_and_note(folder, n):
    marks = ArrivalMarks(folder)
    for k in range(n):
        marks.count(7, start=k == 0)
    marks.mark(9, "dropped (cancelled)")


def test_a_mark_written_by_one_process_is_read_by_another_and_a_reloaded_writer_goes_on_from_it(tmp_path):
    _in_another_process(_count_and_note, tmp_path, 3)
    here = ArrivalMarks(tmp_path)
    assert here.counted(7)[0] == 3 and here.note(9) == "dropped (cancelled)"
    _in_another_process(_count_and_note, tmp_path, 0)   # (a writer in a new process: a new lane)
    assert here.count(7, start=False) == 4, "a stub reloaded under the server goes on from the last count"
    assert here.count(7, start=True) == 1, "a START counts from 1 again"


def test_a_taken_mark_is_read_by_no_one_again_until_the_id_is_marked_anew(tmp_path):
    _in_another_process(_count_and_note, tmp_path, 1)
    taker, other = ArrivalMarks(tmp_path), ArrivalMarks(tmp_path)
    assert taker.take(9) is not None
    assert other.note(9) is None and taker.take(9) is None, "taken for every reader, the taker's lane is newer"
    _in_another_process(_count_and_note, tmp_path, 1)
    assert other.note(9) == "dropped (cancelled)", "marked again after it was taken"


def test_once_a_process_has_its_lane_no_mark_or_read_opens_a_file(tmp_path, monkeypatch):
    marks = ArrivalMarks(tmp_path)
    marks.count(1, start=True)   # the lane is claimed at the first write (the file's lock, once)

    def no(*args, **kwargs):
        raise AssertionError("a file was opened")

    monkeypatch.setattr(builtins, "open", no)
    monkeypatch.setattr(os, "open", no)
    for k in range(100):
        marks.count(1, start=False)
        marks.mark(2 + k, "why")
        assert marks.counted(1)[0] == k + 2 and marks.note(2 + k) == "why"
        marks.take(2 + k)


def test_old_marks_free_their_slots_and_a_full_table_drops_its_oldest(tmp_path):
    now = [1000.0]
    table = MarkTable(tmp_path / "marks", clock=lambda: now[0], retain_s=120.0)
    for cid in range(1, 2 * SLOTS + 1):   # twice the lane's slots, one a second: the old ones go
        now[0] += 1.0
        table.put(cid, count=1)
    assert table.newest(2 * SLOTS).count == 1 and table.newest(2 * SLOTS - 100) is not None, "recent marks kept"
    assert sum(table.newest(cid) is not None for cid in range(1, SLOTS + 1)) < SLOTS // 2, "old slots reused"
    now[0] += 1.0
    for cid in range(10_000_001, 10_000_001 + 2 * SLOTS):   # all within the retention: the oldest make room
        table.put(cid, count=2)
    assert table.newest(10_000_000 + 2 * SLOTS).count == 2


def _claim(folder):
    MarkTable(folder / "marks").put(5, count=1)


def test_a_dead_writers_lane_is_taken_over_only_when_every_lane_has_been_used(tmp_path):
    for _ in range(LANES):
        _in_another_process(_claim, tmp_path)   # each lane's writer has exited
    table = MarkTable(tmp_path / "marks")
    assert table.newest(5).count == 1
    table.put(6, count=3)
    assert table.newest(6).count == 3 and table.newest(5) is not None, "the other dead lanes' marks stay"


def test_a_file_of_another_layout_is_refused(tmp_path):
    path = tmp_path / "marks"
    path.write_bytes(b"\x01" * 64)
    with pytest.raises(ValueError, match="another layout"):
        MarkTable(path)


def test_an_id_outside_the_table_is_refused(tmp_path):
    table = MarkTable(tmp_path / "marks")
    with pytest.raises(ValueError, match="corr_id must be"):
        table.put(0)
    assert mark_table.SIZE < 8 * 2 ** 20, "a kind's table stays a few MiB of /dev/shm (touched pages only)"


def _count_shared(folder, n):
    marks = ArrivalMarks(folder, shared=True)
    for _ in range(n):
        marks.count(7, start=False)


def test_several_admission_instances_count_one_sequence_in_turn(tmp_path):
    """``shared`` (admission_instances > 1): each count reads the last one, whichever process made it, under a lock
    of its own (the table's file is the lanes' claim lock: locking it twice in one process would hang)."""
    first = ArrivalMarks(tmp_path, shared=True)
    assert first.count(7, start=True) == 1
    _in_another_process(_count_shared, tmp_path, 3)
    assert first.count(7, start=False) == 5
    assert ArrivalMarks(tmp_path).counted(7)[0] == 5
