"""The records the python models share between processes (s3flow.serving.records): one schema, one writer each,
written whole. A real server's folders are checked against the schema in tests/test_shutdown.py."""
import multiprocessing
import os

import pytest

from s3flow.server.leftovers import remove_server_files, server_folders
from s3flow.serving.arrivals import KINDS, ArrivalMarks
from s3flow.serving.load import LoadBoard
from s3flow.serving.records import RECORDS, SERVER_FOLDERS, is_temporary, server_folder, write_atomic
from s3flow.serving.voice_registry import default_dir


def test_every_folder_the_models_open_is_a_record_with_one_writer_and_leftovers_sweeps_them_all():
    opened = {ArrivalMarks.default_folder(kind, 1).name for kind in KINDS}
    opened |= {LoadBoard.default_folder(1).name, default_dir(1).name}
    assert opened == {server_folder(name, 1).name for name in SERVER_FOLDERS}
    assert {p.name for p in server_folders(1)} == opened
    assert all(r.writer and r.readers for r in RECORDS) and len({r.name for r in RECORDS}) == len(RECORDS)
    with pytest.raises(ValueError, match="record must be one of"):
        server_folder("live", 1)


def _writer(path, n):
    for i in range(n):
        write_atomic(path, f"{i}\n" + "x" * 20000 + f"\n{i}\n")


def test_a_reader_never_sees_half_a_file_while_another_process_rewrites_it(tmp_path):
    path = tmp_path / "cfm_solver_0"
    write_atomic(path, "0\n" + "x" * 20000 + "\n0\n")
    writer = multiprocessing.get_context("fork").Process(target=_writer, args=(path, 400))
    writer.start()
    seen = 0
    while writer.is_alive() or seen == 0:
        lines = path.read_text().split("\n")   # "i", the body, "i", ""
        assert len(lines) == 4 and lines[0] == lines[2] and len(lines[1]) == 20000, "a half-written file"
        seen += 1
    writer.join()
    assert writer.exitcode == 0 and seen > 1
    assert [p.name for p in tmp_path.iterdir()] == ["cfm_solver_0"], "no temporary file left"


def test_a_file_being_written_is_passed_over_by_its_readers(tmp_path):
    (tmp_path / f"cfm_solver_0.tmp{os.getpid()}-1").write_text("{half")
    assert is_temporary(tmp_path / f"cfm_solver_0.tmp{os.getpid()}-1") and not is_temporary(tmp_path / "x")
    assert LoadBoard(tmp_path).read().reports == []


def test_remove_server_files_removes_every_records_folder(tmp_path):
    pid = 999_999_991   # no such process
    for folder in server_folders(pid):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "7").write_text("1.0\n")
    assert remove_server_files(pid) == len(SERVER_FOLDERS)
    assert not any(f.exists() for f in server_folders(pid))


def _publish_and_exit(folder, instance):
    from s3flow.engine.capacity import CapacityModel, Work
    from s3flow.serving.load import InstanceLoad
    InstanceLoad(LoadBoard(folder), instance, "solver", CapacityModel(), cap=4).publish({11: Work(), 12: Work()})


def test_a_load_report_whose_writer_died_is_passed_over_and_its_successor_takes_its_lane(tmp_path):
    """Issue 53: a solver stub killed under the server left its last load report, and admission refused traffic by
    it (utilization 0.49-0.59 of a dead process) for as long as the server ran."""
    from s3flow.engine.capacity import CapacityModel, Work
    from s3flow.serving.load import InstanceLoad

    dead = multiprocessing.get_context("fork").Process(target=_publish_and_exit, args=(tmp_path, "cfm_solver_0_1"))
    dead.start()
    dead.join()
    board = LoadBoard(tmp_path)
    InstanceLoad(board, "cfm_solver_0_0", "solver", CapacityModel(), cap=4).publish({1: Work()})
    assert set(board.board.read()) == {"cfm_solver_0_0", "cfm_solver_0_1"}, "the dead one's report is still there"
    load = board.read()
    assert load.solver_ids == {1} and load.cap == 4, "the dead instance's streams and slots do not count"
    again = board.read()   # (nothing changed: the same load)
    assert load.reports[0].pid == os.getpid() and again is load
    reloaded = LoadBoard(tmp_path)   # the stub reloaded under the server: its predecessor's lane
    InstanceLoad(reloaded, "cfm_solver_0_1", "solver", CapacityModel(), cap=4).publish({5: Work()})
    assert board.read().solver_ids == {1, 5} and board.read().cap == 8
    assert reloaded.board._lanes == {"cfm_solver_0_1": 0}, "the lane the dead one wrote first, not a new one"


def _rewrite(folder, n):
    from s3flow.serving.report_board import ReportBoard
    board = ReportBoard(folder / "board")
    for i in range(n):
        board.write("cfm_solver_0", f"{i}\n".encode() + b"x" * (20000 + 7 * (i % 13)) + f"\n{i}".encode())


def test_a_reader_never_sees_half_a_report_while_another_process_rewrites_it(tmp_path):
    from s3flow.serving.report_board import ReportBoard

    board = ReportBoard(tmp_path / "board")
    board.write("cfm_solver_0", b"0\n" + b"x" * 20000 + b"\n0")
    writer = multiprocessing.get_context("fork").Process(target=_rewrite, args=(tmp_path, 2000))
    writer.start()
    seen = set()
    while writer.is_alive() or not seen:
        pid, payload = board.read()["cfm_solver_0"]
        first, body, last = payload.split(b"\n")
        assert first == last and len(body) >= 20000, "a half-written report"
        seen.add(first)
    writer.join()
    assert writer.exitcode == 0 and len(seen) > 1, "the reader saw the writer's reports as they came"


def test_a_closed_instances_report_is_gone_and_a_report_too_big_for_its_lane_is_refused(tmp_path):
    from s3flow.serving.report_board import PAYLOAD_BYTES, ReportBoard

    board = ReportBoard(tmp_path / "board")
    board.write("vocoder_0_0", b"{}")
    board.clear("vocoder_0_0")
    assert board.read() == {}
    with pytest.raises(ValueError, match="at most"):
        board.write("vocoder_0_0", b"x" * (PAYLOAD_BYTES + 1))


def test_the_vocoder_holding_a_stream_says_when_it_was_last_free(tmp_path):
    """``Delivery``'s reading of the vocoders' reports: the instance holding the stream answers for it; a stream no
    vocoder holds yet is judged by the one seen free longest ago; with no vocoder report, nothing is known."""
    from s3flow.engine.capacity import CapacityModel, Work
    from s3flow.serving.load import InstanceLoad

    files = LoadBoard(tmp_path)
    assert files.read().vocoder_free_at(7) is None
    InstanceLoad(files, "vocoder_0_0", "vocoder", CapacityModel()).publish({7: Work(steps=1)}, free_at=10.0)
    InstanceLoad(files, "vocoder_0_1", "vocoder", CapacityModel()).publish({8: Work()}, free_at=20.0)
    load = files.read()
    assert (load.vocoder_free_at(7), load.vocoder_free_at(8), load.vocoder_free_at(9)) == (10.0, 20.0, 10.0)


def test_a_load_report_is_written_at_once_when_its_streams_change_and_at_most_every_period_else(tmp_path):
    """``InstanceLoad.publish`` with ``every_s``: the same streams held (their work moved) are not written again
    within the period; a START, an END (a stream just ended) or ``force`` is written at once (issue 49: writing
    after every answer was most of the load report's system calls)."""
    from s3flow.engine.capacity import CapacityModel, Work
    from s3flow.serving.load import InstanceLoad

    files = LoadBoard(tmp_path)
    load = InstanceLoad(files, "cfm_solver_0_0", "solver", CapacityModel(), cap=4, every_s=60.0)
    assert load.publish({1: Work()}) is not None
    assert load.publish({1: Work(steps=2, chunks=1, frames=20)}) is None, "the same stream, within the period"
    assert files.read().reports[0].waiting == [1], "the file still holds the first report"
    assert load.publish({1: Work(steps=2, chunks=1, frames=20), 2: Work()}) is not None, "a START"
    assert load.publish({2: Work()}, ended=[1]) is not None, "an END"
    assert load.publish({2: Work()}, ended=[1], force=True) is not None, "forced"
    assert sorted(files.read().solver_recent_ids) == [1, 2]


def test_a_dead_writers_pid_taken_by_a_new_writer_is_alive_again(tmp_path):
    """PIDs are reused: a pid once seen dead that publishes a new report is a live writer (the watch forgets it)."""
    from s3flow.engine.capacity import CapacityModel, Work
    from s3flow.serving.load import InstanceLoad
    from s3flow.serving.records import writer_watch

    board = LoadBoard(tmp_path)
    InstanceLoad(board, "cfm_solver_0_0", "solver", CapacityModel(), cap=4).publish({1: Work()})
    assert board.read().solver_ids == {1}
    watch = writer_watch()
    with watch._lock:
        watch._dead.add(os.getpid())   # as if this pid had been seen to exit before (another process's)
    assert not watch.alive(os.getpid())
    InstanceLoad(board, "cfm_solver_0_0", "solver", CapacityModel(), cap=4).publish({2: Work()})
    assert board.read().solver_ids == {2}, "its new report counts"
