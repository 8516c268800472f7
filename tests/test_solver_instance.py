"""One cfm_solver instance without a server (``s3flow.serving.solver_instance``): built from its config's parameters
as the model file builds it, over the small seeded flow in process; its one way in and one way out in both
schedulings (fifo: a batch solved whole on the caller's thread, then each answered; deadline: each request answered
from the step loop's thread), the load report it publishes for admission and the vocoder, what it does when a
sequence is dropped (gone mark, slot release, log), and the settings it refuses."""
from __future__ import annotations

import os
import threading

import pytest

from helpers import request_inputs, small_flow, torch_encoder
from s3flow.model.flow import TorchEstimator
from s3flow.repository.configs import solver_config
from s3flow.repository.settings import RepositorySettings
from s3flow.server.leftovers import remove_server_files
from s3flow.serving.arrivals import ArrivalMarks
from s3flow.serving.config_params import Params
from s3flow.serving.load import LoadBoard
from s3flow.serving.metrics import LIVE
from s3flow.serving.incoming import Incoming
from s3flow.serving.solver_instance import SolverInstance
from s3flow_client.demo import demo_utterance

pytestmark = pytest.mark.usefixtures("one_torch_thread")
U = demo_utterance(1.2, seed=5)


class Slots:
    """The slot release's side the instance uses (``slots.SlotRelease`` sends BLS requests in the stub)."""

    def __init__(self):
        self.dropped_ids, self.started_ids, self.sends = [], [], 0

    def dropped(self, corr_id):
        self.dropped_ids.append(corr_id)

    def started(self, corr_id):
        self.started_ids.append(corr_id)

    def send(self):
        self.sends += 1


@pytest.fixture(scope="module")
def flow():
    return small_flow(seed=3)


@pytest.fixture
def records():
    """The instance's records are its server's: outside one, the folders of this test's parent; removed after."""
    remove_server_files(os.getppid())
    yield
    remove_server_files(os.getppid())


def instance(flow, scheduling: str = "fifo", parameters: dict | None = None):
    config = solver_config(flow.config.n_feats, flow.config.meanflow,
                           RepositorySettings(scheduling=scheduling, warmup=False))
    raw = {k: {"string_value": v.string_value} for k, v in config.parameters.items()}
    raw.update({k: {"string_value": str(v)} for k, v in {"calibrate": "false", "default_steps": 2, **(parameters or {})}.items()})
    published, logged, slots = [], [], Slots()
    solver = SolverInstance(Params({"parameters": raw}, "cfm_solver"), "cfm_solver", "cfm_solver_0",
                            torch_encoder(flow), TorchEstimator(flow.estimator),
                            lambda family, value, labels: published.append((family.name, value)), slots,
                            batch_size=4, log=lambda level, m: logged.append(m))
    return solver, published, logged, slots


class Answers:
    """Every answer sent, by request, with the thread that sent it."""

    def __init__(self):
        self.sent: list[tuple[int, object, str]] = []
        self.cond = threading.Condition()

    def send(self, corr_id: int):
        def sent(o):
            with self.cond:
                self.sent.append((corr_id, o, threading.current_thread().name))
                self.cond.notify_all()
        return sent

    def wait(self, count: int, timeout_s: float = 60.0) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.sent) >= count, timeout_s), f"{count} answers: {self.sent}"
            return [o for _, o, _ in self.sent]


def chunk(corr_id: int, lo: int, hi: int, start: bool = False, end: bool = False, cancelled: bool = False,
          answers: Answers | None = None):
    return Incoming(corr_id, start=start, end=end, inputs=request_inputs(U, lo, hi, start),
                    is_cancelled=lambda: cancelled, send=(answers or Answers()).send(corr_id))


def solved(solver, *chunks) -> list:
    """Submit the chunks (fifo: solved on this thread) and return their answers, in order."""
    answers = Answers()
    for c in chunks:
        c.send = answers.send(c.corr_id)
    solver.submit(list(chunks))
    return answers.wait(len(chunks))


def test_fifo_solves_a_batch_whole_and_reports_its_load_for_admission(flow, records):
    solver, published, logged, slots = instance(flow)
    try:
        answers = Answers()
        solver.submit([chunk(1, 0, 10, start=True, answers=answers), chunk(2, 0, 14, start=True, answers=answers)])
        assert [corr_id for corr_id, _, _ in answers.sent] == [1, 2], "answered before submit returns, in order"
        assert {thread for _, _, thread in answers.sent} == {threading.current_thread().name}
        outcomes = answers.wait(2)
        assert [o.result.frame_offset for o in outcomes] == [0, 0] and all(o.error is None for o in outcomes)
        assert [v for name, v in published if name == "s3flow_chunk_seconds"] != [], "each answer's seconds"
        assert slots.started_ids == [1, 2], "a START's id is in use again: no release pending for it"
        load = LoadBoard(LoadBoard.default_folder()).read()
        assert load.solver_ids == {1, 2} and load.cap == solver.settings.sequences.max_live_sequences
        assert [r.streams[1].steps for r in load.reports] == [2], "each stream's work, as the table keeps it"
        assert [v for name, v in published if name == LIVE.name][-1] == 2
        [o] = solved(solver, chunk(1, 10, 30, end=True))
        assert o.result is not None and 1 not in solver.table
        assert LoadBoard(LoadBoard.default_folder()).read().solver_recent_ids == {1, 2}, "1 ended moments ago"
    finally:
        solver.close()


def test_a_dropped_sequence_is_marked_gone_its_slot_released_and_logged(flow, records):
    solver, published, logged, slots = instance(flow)
    try:
        solved(solver, chunk(3, 0, 10, start=True))
        [o] = solved(solver, chunk(3, 10, 20, cancelled=True))
        assert o.code == "CANCELLED" and 3 not in solver.table
        assert slots.dropped_ids == [3]
        assert ArrivalMarks(ArrivalMarks.default_folder("gone")).note(3) == "dropped (cancelled)"
        assert logged[-1] == "cfm_solver: dropped sequence 3 (cancelled); 0 live"
        solved(solver, chunk(3, 0, 10, start=True))   # the id starts again: admission must not refuse it
        assert ArrivalMarks(ArrivalMarks.default_folder("gone")).note(3) is None
    finally:
        solver.close()


def test_deadline_answers_each_request_from_the_step_loop_thread(flow, records):
    solver, published, logged, slots = instance(flow, "deadline")
    answers = Answers()
    try:
        solver.submit([chunk(1, 0, 10, start=True, answers=answers), chunk(2, 0, 12, start=True, answers=answers),
                       chunk(1, 10, 20, answers=answers)])
        outcomes = answers.wait(3)
        assert all(o.error is None for o in outcomes)
        by_id = {}
        for corr_id, o, _ in answers.sent:
            by_id.setdefault(corr_id, []).append(o.result.frame_offset)
        assert by_id[1][0] == 0 < by_id[1][1] and by_id[2] == [0], "a sequence's chunks answered in order"
        assert {thread for _, _, thread in answers.sent} == {"cfm_solver-step-loop"}
    finally:
        solver.close()
    assert not solver._thread.is_alive() and not solver.reaper._thread.is_alive(), "no thread outlives it"


def test_a_request_without_its_send_is_refused_before_anything_is_taken(flow, records):
    solver, published, logged, slots = instance(flow)
    try:
        with pytest.raises(ValueError, match="needs its send"):
            solver.submit([Incoming(1, start=True, end=False, inputs=request_inputs(U, 0, 10, True))])
        assert slots.started_ids == [] and 1 not in solver.table
    finally:
        solver.close()


def test_an_unknown_scheduling_is_refused(flow, records):
    with pytest.raises(ValueError, match="scheduling must be one of"):
        instance(flow, parameters={"scheduling": "lifo"})
