"""Admission ahead of the sequence batcher (s3flow.serving.admission), without a server: a START that would be
refused is refused here with the solver's disposition, later chunks pass, the live count is the solver
instances' ids plus STARTs admitted but not yet counted (never both), and a restart on a live id takes no slot."""
import dataclasses
import time

import numpy as np
import pytest

from helpers import request_inputs
from s3flow_contract.answers import Disposition
from s3flow.engine.capacity import DUTY_PRIOR, AdmissionTarget, CapacityModel, Work
from s3flow.engine.settings import SolverSettings
from s3flow.protocol import RequestRules
from s3flow.serving.admission import Admission
from s3flow.serving.load import InstanceLoad, LoadBoard
from s3flow.serving.voice_registry import UnknownVoice
from s3flow_client.demo import demo_utterance

from s3flow.serving.calibration import planned_start

PLAN, STEPS, ROWS = planned_start(SolverSettings(), n_feats=80, meanflow=False)
U = demo_utterance(1.0, seed=1)
START = request_inputs(U, 0, 10, True)


def test_a_valid_start_and_every_later_chunk_pass():
    a = Admission(RequestRules(), n_feats=80)
    assert a.check(1, True, False, START) is None
    bad = dict(request_inputs(U, 10, 20, False), speech_tokens=np.array([[7000]], np.int64))
    assert a.check(1, False, False, bad) is None, "a later chunk is the solver's to validate"


def test_an_invalid_start_is_refused_with_fail_naming_the_value():
    bad = dict(START, speech_tokens=np.array([[1, 7000]], np.int64))
    o = Admission(RequestRules(), n_feats=80, name="admission").check(5, True, False, bad)
    assert o.code == "INVALID_ARG" and o.answer.disposition is Disposition.FAIL and o.answer.sequence == 5
    assert o.error == "admission: sequence 5: speech_tokens must be in [0, 6561), got 7000"


def test_an_unknown_voice_asks_for_the_prompt_and_draining_sends_elsewhere():
    def voices(voice_id, tenant=""):
        raise UnknownVoice(f"voice_id {voice_id} is not registered on this server")
    from s3flow_contract.tensors import request_arrays
    by_id = request_arrays(U.speech_tokens[:5], start=True, voice_id="v-0000000000000000")
    o = Admission(RequestRules(), 80, voices=voices).check(2, True, False, by_id)
    assert o.answer.disposition is Disposition.RETRY and o.answer.resend == "prompt" and "not registered" in o.error
    o = Admission(RequestRules(), 80, draining=lambda: True).check(3, True, False, START)
    assert o.code == "UNAVAILABLE" and o.answer.disposition is Disposition.RESUME and "draining" in o.error


class Live:
    """A solver instance's load report as admission reads it: its live ids, its cap and those it ended moments ago
    (nothing priced yet)."""

    def __init__(self, folder):
        self.files = LoadBoard(folder)

    def write(self, instance, live_ids, cap, recent=()):
        from s3flow.engine.capacity import CapacityModel, Work
        InstanceLoad(self.files, instance, "solver", CapacityModel(), cap=cap).publish(
            {c: Work() for c in live_ids}, recent)

    def remove(self, instance):
        self.files.remove(instance)

    def read(self):
        load = self.files.read()
        return load.solver_ids, load.cap


def test_capacity_counts_live_ids_and_recent_admissions_once(tmp_path):
    live = Live(tmp_path)
    now = [0.0]
    a = Admission(RequestRules(), 80, load=live.files, grace_s=1.0, clock=lambda: now[0],
                  target=AdmissionTarget(utilization_target=0))   # the cap alone (nothing priced here)
    live.write("cfm_solver_0", [], cap=2)
    assert a.check(1, True, False, START) is None            # admitted, not yet listed by the solver
    live.write("cfm_solver_0", [1], cap=2)                    # the solver lists it: counted once, not twice
    assert a.check(2, True, False, START) is None
    full = a.check(3, True, False, START)
    assert full.code == "UNAVAILABLE" and full.answer.disposition is Disposition.BUSY
    assert full.answer.retry_after_s == 1.0 and "too many live sequences (2, max_live_sequences 2)" in full.error
    assert a.check(1, True, False, START) is None, "a restart on a live id takes no new slot"
    a._admitted.clear()
    live.write("cfm_solver_0", [], cap=2)
    assert a.check(5, True, False, START) is None and a.check(6, True, False, START) is None
    a.check(5, False, True, request_inputs(U, 10, 12, False))   # 5 ended before the solver ever listed it
    assert a.check(7, True, False, START) is None, "an ended sequence is not counted as pending"
    now[0] += 1.5                                             # the solver never listed sequence 2: it went away
    assert a.check(3, True, False, START) is None, "an admission not listed after the grace stops counting"


def test_live_counts_sum_the_instances_and_forget_one_that_unloads(tmp_path):
    live = Live(tmp_path)
    live.write("cfm_solver_0", [1, 2], cap=4)
    live.write("cfm_solver_1", [7], cap=4)
    (tmp_path / "cfm_solver_2.tmp123-4").write_text("garbage")     # a half-written file is not read
    assert live.read() == ({1, 2, 7}, 8)
    live.remove("cfm_solver_1")
    assert live.read() == ({1, 2}, 4)


def _solver_load(folder, live_ids, per_stream: float):
    """A solver instance's load report whose streams (no answer yet: priced by the plan) each need ``per_stream``
    of the device: costs scaled to make it so."""
    from s3flow.engine.capacity import CapacityModel, Costs, Work
    from s3flow.engine.settings import SolverSettings
    from s3flow.serving.calibration import planned_start

    plan, steps, rows = planned_start(SolverSettings(), 80, False)
    model = CapacityModel(max_batch=1)
    # a stream with nothing answered yet is priced by what its ramp needs (Plan.start_need), here per unit only;
    # before any work the capacity is the plan's times the busy share at capacity (DUTY_PRIOR), so every demand is
    # the costs' over DUTY_PRIOR
    per_unit_need = plan.start_need(Costs(est_per_unit=1.0), 1.0)
    model.estimator_timed(1, 1000, 1000 * per_stream * DUTY_PRIOR / per_unit_need)
    files = LoadBoard(folder)
    InstanceLoad(files, "cfm_solver_0", "solver", model, plan, steps, rows).publish({c: Work() for c in live_ids})
    return files


def test_a_burst_refused_against_one_load_looks_ahead_once_and_a_new_report_is_priced_afresh(tmp_path):
    """Refusing a START computes its retry_after by looking ahead along every stream's plan (most of a refusal's
    time: 100 refusals at once took 2-3 ms each served under load, 0.8-1.4 ms with it kept); the same load asks
    the same question, so a burst looks ahead once. A changed report is a new load, priced again."""
    from s3flow.engine.capacity import AdmissionTarget
    from s3flow.serving.load import ServerLoad

    files = _solver_load(tmp_path / "load", [1, 2], per_stream=0.3)
    a = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.5))
    looked = []
    original = ServerLoad._wait_until
    ServerLoad._wait_until = lambda self, *args: looked.append(id(self)) or original(self, *args)
    try:
        refusals = [a.check(10 + k, True, False, START) for k in range(20)]
        assert all(r is not None and r.answer.retry_after_s for r in refusals)
        assert len({r.answer.retry_after_s for r in refusals}) == 1, "one load, one answer"
        assert len(looked) == 1, f"looked ahead {len(looked)} times for 20 refusals against one load"
        _solver_load(tmp_path / "load", [1, 2, 3], per_stream=0.3)   # a third stream: a new report
        assert a.check(40, True, False, START) is not None
        assert len(looked) == 2 and looked[0] != looked[1], "the new load is priced afresh"
    finally:
        ServerLoad._wait_until = original


def test_a_start_right_after_the_last_end_is_judged_by_the_report_written_at_that_end(tmp_path):
    """The solver rewrites its report at every END; a START a few ms later sees it (issue 39: reports cached 50 ms
    refused a START on an idle server by the stream that had just ended)."""
    from s3flow.engine.capacity import AdmissionTarget

    files = _solver_load(tmp_path / "load", [1], per_stream=0.3)
    a = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.2))
    assert a.check(2, True, False, START) is not None, "0.3 held + 0.3 is over 0.2"
    assert a.load.read() is a.load.read(), "unchanged reports are parsed once"
    _solver_load(tmp_path / "load", [], per_stream=0.3)   # the END: the same file, rewritten
    assert a.check(3, True, False, START) is None, "an idle server takes a stream"
    assert LoadBoard(tmp_path / "load").read().solver_ids == set()


def test_a_start_over_the_utilization_target_is_refused_busy_with_a_retry_after(tmp_path):
    from s3flow.engine.capacity import AdmissionTarget

    files = _solver_load(tmp_path / "load", [1, 2], per_stream=0.3)
    a = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.97))
    assert a.check(1, True, False, START) is None, "a restart on a live id replaces its stream"
    assert a.check(3, True, False, START) is None                     # 0.6 + 0.3 fits
    o = a.check(4, True, False, START)                                # 3 admitted, not yet held: counted
    assert o.code == "UNAVAILABLE" and o.answer.disposition is Disposition.BUSY and o.answer.sequence == 4
    assert 0.2 <= o.answer.retry_after_s <= 5.0
    assert "at capacity: the solver's utilization 0.90 + 0.30 for this stream is above the target 0.97" in o.error
    cheap = dict(START, n_timesteps=np.array([[2]], np.int32))        # 2 of the default 10 steps: 0.06 fits
    assert a.check(5, True, False, cheap) is None
    off = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.0))
    assert all(off.check(10 + k, True, False, START) is None for k in range(5)), "target 0: no capacity check"


def test_the_demand_offered_counts_what_is_held_and_each_start_refused_for_room_once_for_its_window(tmp_path):
    """What the HPA scales on (``s3flow_demand``): a server that refuses holds less than its target by about one
    stream's price (0.54-0.59 held while eleven were refused, under the HPA's 0.7); what it refused counts too, one
    steady stream each (1 / capacity), each id once (a retry of the same id asks for one stream), for
    ``DEMAND_WINDOW_S``, and no more once it got in."""
    from s3flow.engine.capacity import AdmissionTarget
    from s3flow.serving.demand import DEMAND_WINDOW_S

    now = [100.0]
    files = _solver_load(tmp_path / "load", [1, 2], per_stream=0.3)
    steady = 1.0 / files.read().capacity
    assert 0.05 < steady < 0.3, "a steady stream costs less than a START"
    a = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.7),
                  clock=lambda: now[0])
    assert a.offered(files.read()) == pytest.approx(0.6, rel=1e-3), "what it holds"
    assert a.offered(files.read(), share=0.5) == pytest.approx(0.3, rel=1e-3), "one of two admission instances"
    assert all(a.check(c, True, False, START) is not None for c in (3, 4, 3))   # 0.6 + 0.3 > 0.7: both refused
    assert a.offered(files.read()) == pytest.approx(0.6 + 2 * steady, rel=1e-3), "two refused, 3 retried once"
    now[0] += DEMAND_WINDOW_S - 1
    assert a.check(5, True, False, START) is not None
    now[0] += 2   # 3 and 4 left the window
    assert a.offered(files.read()) == pytest.approx(0.6 + steady, rel=1e-3)
    _solver_load(tmp_path / "load", [1], per_stream=0.3)   # a stream ended: 5 retries and gets in
    assert a.check(5, True, False, START) is None
    assert a.offered(files.read()) == pytest.approx(0.6, rel=1e-3), "held (1) and admitted (5), no refused"


def _vocoder_report(files, live_ids, per_stream: float):
    """A vocoder instance's report whose streams (2 s of audio each) each need ``per_stream`` of the device."""
    from s3flow.engine.capacity import CapacityModel, Work
    from s3flow.serving.load import InstanceLoad

    model = CapacityModel(max_batch=1, duty_prior=None)
    model.estimator_timed(1, 100, 2.0 * per_stream)
    InstanceLoad(files, "vocoder_0", "vocoder", model).publish({c: Work(row_frames=100, steps=1, frames=100)
                                                                 for c in live_ids})


def test_token2wav_admits_by_its_busiest_stage_not_the_solvers_and_vocoders_demands_added(tmp_path):
    """The solver's costs are measured with the vocoder beside it on the device (issue 39: token2wav admitted 1
    stream where floor(0.8 C) = 2 fit, the vocoder's demand added on top of the solver's): a START fits when it fits
    the solver and the vocoder each; a vocoder with no room refuses it, naming the vocoder."""
    from s3flow.engine.capacity import AdmissionTarget

    files = _solver_load(tmp_path / "load", [1, 2], per_stream=0.25)
    _vocoder_report(files, [1, 2], per_stream=0.1)
    a = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.8))
    assert a.check(3, True, False, START) is None, "solver 0.5 + 0.25, vocoder 0.2 + 0.1: both fit (added: 1.05)"
    assert files.read().utilization() == pytest.approx(0.5, rel=1e-3), "the busiest stage's"

    busy = tmp_path / "busy"
    files = _solver_load(busy, [1, 2], per_stream=0.1)
    _vocoder_report(files, [1, 2], per_stream=0.35)
    a = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.8))
    o = a.check(3, True, False, START)
    assert o is not None and o.answer.disposition is Disposition.BUSY
    assert "the vocoder's utilization 0.70 + 0.35 for this stream is above the target 0.80" in o.error, o.error


def test_a_start_is_priced_as_what_its_ensemble_makes_a_token2wav_one_with_the_vocoders_work(tmp_path):
    """Issue 48: admission could not tell a token2wav START from a token2mel one (a restarted server admitted 6 of 10
    token2wav STARTs priced as token2mel's; all 6 stalled). A token2wav START (``audio``) is priced against
    token2wav's capacity (the solver's and the vocoder's device time, ``wav_factor``) and needs the vocoder even
    when it holds no stream yet (one over its capacity); a token2mel one needs no vocoder; a stream the vocoder
    holds is token2wav's wherever it is priced."""
    from s3flow.engine.capacity import AdmissionTarget
    from s3flow.serving.load import VOCODER_OVERLAP, LoadReport

    files = _solver_load(tmp_path / "load", [1, 2], per_stream=0.2)
    capacity = files.read().capacity
    # a vocoder slower than the solver: token2wav takes its time and part of the solver's (load.VOCODER_OVERLAP):
    # with the overlap at 0.5, twice the solver's time per audio second
    assert VOCODER_OVERLAP == 0.5
    files.write("vocoder_0", LoadReport("vocoder", capacity=capacity / 1.5))
    load = files.read()
    assert load.wav_factor == pytest.approx(2.0)
    [mel] = load.stages(audio=False)
    solver, vocoder = load.stages(audio=True)
    assert mel.now == pytest.approx(solver.now) == pytest.approx(0.4, rel=1e-3), "streams 1, 2: token2mel's"
    assert solver.need == pytest.approx(2 * mel.need) and mel.need == pytest.approx(0.2, rel=1e-3)
    assert vocoder.need == pytest.approx(1.5 / capacity), "none held: the vocoder's price of one real-time stream"
    a = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.7))
    assert a.check(3, True, False, START, audio=False) is None, "token2mel: 0.4 + 0.2 fits under 0.7"
    o = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.7)).check(
        4, True, False, START, audio=True)
    assert o is not None and o.answer.disposition is Disposition.BUSY
    assert f"the solver's utilization 0.40 + 0.40 for this token2wav stream is above the target 0.70 (capacity " \
           f"{capacity / 2:.1f} audio s per s)" in o.error, o.error

    files.write("vocoder_0", LoadReport("vocoder", capacity=capacity / 1.5, waiting=[1, 2]))   # 1, 2 vocode
    [held] = files.read().stages(audio=False)
    assert held.now == pytest.approx(0.8, rel=1e-3), "token2wav streams take twice the solver's share"
    o = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.9)).check(
        5, True, False, START, audio=False)
    assert o is not None and "0.80 + 0.20" in o.error, o.error


def test_before_the_solver_priced_anything_an_idle_server_takes_one_and_the_rest_wait_then_hear_busy(tmp_path):
    """Issue 48: a burst right after start-up went in unpriced (10 of 10 admitted, all stalled). Before every solver
    instance has priced its work a START waits for that (bounded), and is judged by it once it comes; if it does not
    come in time, only an idle server takes a START."""
    import threading
    from s3flow.engine.capacity import AdmissionTarget
    from s3flow.serving.load import LoadBoard

    live = Live(tmp_path / "load")
    live.write("cfm_solver_0", [], cap=64)
    a = Admission(RequestRules(), 80, load=live.files, target=AdmissionTarget(), pricing_wait_s=0.3)
    t0 = time.monotonic()
    assert a.check(1, True, False, START) is None, "an idle server takes the first"
    busy = a.check(2, True, False, START)
    waited = time.monotonic() - t0
    assert busy is not None and busy.answer.disposition is Disposition.BUSY and "not priced" in busy.error
    assert 0.3 <= waited < 2.0, f"the second START waited for the pricing, bounded: {waited:.2f} s"

    files = LoadBoard(tmp_path / "priced")            # the pricing arrives while a START waits: judged by it
    unpriced = InstanceLoad(files, "cfm_solver_0", "solver", CapacityModel(), PLAN, STEPS, ROWS, cap=64)
    unpriced.publish({1: Work()})
    b = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.97), pricing_wait_s=5.0)
    model = CapacityModel(max_batch=8)
    model.estimator_timed(2, 100, 0.003)
    model.estimator_timed(8, 100, 0.009)
    later = threading.Timer(0.2, lambda: InstanceLoad(files, "cfm_solver_0", "solver", model, PLAN, STEPS, ROWS,
                                                        cap=64).publish({1: Work()}))
    later.start()
    t0 = time.monotonic()
    outcome = b.check(2, True, False, START)
    later.join()
    assert 0.15 <= time.monotonic() - t0 < 2.0, "it waited for the calibration's report, not for the bound"
    assert files.read().known and (outcome is None or "not priced" not in outcome.error), "judged by the prices"


def test_a_solver_instance_not_yet_priced_is_priced_as_its_priced_sibling(tmp_path):
    """The CPU layout's two solver instances: the one that took a new server's first stream cannot calibrate while
    it holds it, and admission waited for all to be priced (a burst's STARTs about 1 s more). Priced as its sibling,
    the server is known once one is, its capacity theirs summed, and what the unpriced one holds still counts."""
    files = _solver_load(tmp_path / "load", [1], per_stream=0.2)        # cfm_solver_0: priced, holds 1
    InstanceLoad(files, "cfm_solver_1", "solver", CapacityModel(), PLAN, STEPS, ROWS).publish({2: Work()})
    load = files.read()
    one = _solver_load(tmp_path / "one", [1], per_stream=0.2).read()
    assert load.known and load.solver_ids == {1, 2}
    assert load.capacity == pytest.approx(2 * one.capacity)
    [stage] = load.stages(audio=False)
    assert stage.now == pytest.approx(2 * 0.2 / 2, rel=1e-3), "two streams of 0.2 each over twice the capacity"
    alone = LoadBoard(tmp_path / "alone")
    InstanceLoad(alone, "cfm_solver_1", "solver", CapacityModel(), PLAN, STEPS, ROWS).publish({2: Work()})
    assert not alone.read().known, "none priced: not known"


def test_a_token2wav_start_waits_for_the_vocoders_price_and_a_token2mel_one_does_not(tmp_path):
    """Issue 48: a new server's vocoder had no price before its first push, so its first token2wav burst was priced
    by the solver alone (5 / 5 / 4 admitted, 4 / 4 / 3 stalled). The vocoder calibrates right after the solver; a
    token2wav START that comes between waits for that price (bounded) and is judged by it; a token2mel START needs
    no vocoder and is judged at once."""
    import threading
    from s3flow.engine.capacity import AdmissionTarget
    from s3flow.serving.load import LoadReport

    files = _solver_load(tmp_path / "load", [1], per_stream=0.2)   # the solver priced, one stream held
    files.write("vocoder_0", LoadReport("vocoder"))                  # the vocoder not yet
    assert files.read().known and not files.read().known_for(True) and files.read().known_for(False)
    capacity = files.read().capacity
    a = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.7), pricing_wait_s=5.0)
    t0 = time.monotonic()
    assert a.check(2, True, False, START, audio=False) is None, "token2mel: 0.2 + 0.2 fits, judged at once"
    assert time.monotonic() - t0 < 1.0
    # its price comes while the token2wav START waits: a vocoder at a third of the solver's speed makes token2wav's
    # share of the solver 0.2 x 3.5, which does not fit beside the two streams held
    later = threading.Timer(0.2, lambda: files.write("vocoder_0", LoadReport("vocoder", capacity=capacity / 3)))
    later.start()
    t0 = time.monotonic()
    o = a.check(3, True, False, START, audio=True)
    later.join()
    assert time.monotonic() - t0 >= 0.15, "it waited for the vocoder's price"
    assert o is not None and "for this token2wav stream" in o.error, "judged with the vocoder's price"
    unpriced = Admission(RequestRules(), 80, load=_solver_load(tmp_path / "b", [1], per_stream=0.2),
                         target=AdmissionTarget(utilization_target=0.7), pricing_wait_s=5.0)
    assert unpriced.check(3, True, False, START, audio=True) is None, "no vocoder at all: the solver's price alone"


def test_a_start_that_waited_for_the_price_counts_as_pending_for_the_starts_queued_behind_it(tmp_path):
    """A START admitted after waiting for the price is counted from when it was admitted, not from when it came: the
    STARTs queued behind it are judged at once when the price comes, before the solver lists it (issue 48: stamped
    with its arrival, it had left the count by then, and a new server admitted 7-8 of a burst, all stalled)."""
    import threading
    from s3flow.engine.capacity import AdmissionTarget

    folder = tmp_path / "load"
    files = LoadBoard(folder)
    InstanceLoad(files, "cfm_solver_0", "solver", CapacityModel(), PLAN, STEPS, ROWS, cap=64).publish({1: Work()})
    a = Admission(RequestRules(), 80, load=files, target=AdmissionTarget(utilization_target=0.7), grace_s=0.1,
                  pricing_wait_s=5.0)
    later = threading.Timer(0.3, lambda: _solver_load(folder, [1], per_stream=0.3))   # the calibration's report
    later.start()
    assert a.check(2, True, False, START) is None, "0.3 held + 0.3 fits under 0.7, once priced"
    later.join()
    third = a.check(3, True, False, START)
    assert third is not None and "0.60 + 0.30" in third.error, "the START admitted a moment ago is pending"


def test_live_counts_list_the_recently_ended_for_the_vocoder_but_admission_counts_only_the_live(tmp_path):
    live = Live(tmp_path)
    live.write("cfm_solver_0", [1, 2], cap=4, recent=[9, 2])
    live.write("cfm_solver_1", [7], cap=4)
    assert live.read() == ({1, 2, 7}, 8)
    assert live.files.read().solver_recent_ids == {1, 2, 7, 9}


# ------------------------------------------------------------------------------------------ as the solver answers
def _unknown_voice(voice_id, tenant=""):
    raise UnknownVoice(f"voice_id {voice_id} is not registered on this server")


@pytest.mark.parametrize("name", ["invalid request", "unknown voice", "draining", "full", "sequence not held"])
def test_admission_answers_each_refusal_it_shares_with_the_solver_as_the_solver_does(name, tmp_path):
    """Each refusal both make (s3flow.serving.incoming.refusal), set up the same way on either: the same code and
    answer (disposition, sequence, resend, a retry time when busy); where the cause is the request or the server's
    state, not its load, the same words after each model's name."""
    from s3flow_contract.tensors import request_arrays
    from s3flow.engine.sequences import SequenceLimits
    from s3flow.engine.streaming import StreamingEngine
    from s3flow.serving.arrivals import ArrivalMarks
    from s3flow.serving.incoming import Incoming
    from s3flow.serving.session import SolverSession

    engine = StreamingEngine(None, None, n_feats=80, meanflow=False, limits=SequenceLimits(max_live_sequences=1))
    solver = SolverSession(engine, RequestRules(), name="cfm_solver")   # refusals never reach the models
    live = Live(tmp_path / "load")
    live.write("cfm_solver_0", [], cap=1)
    admission = Admission(RequestRules(), 80, load=live.files, gone=ArrivalMarks(tmp_path / "gone"))
    inputs, start = START, True
    if name == "invalid request":
        inputs = dict(START, speech_tokens=np.array([[1, 7000]], np.int64))
    elif name == "unknown voice":
        solver.voices = admission.voices = _unknown_voice
        inputs = request_arrays(U.speech_tokens[:5], start=True, voice_id="v-0123456789abcdef")
    elif name == "draining":
        solver.draining = admission.draining = lambda: True
    elif name == "full":   # sequence 1 holds the only slot
        chunk, answered = solver.admit(Incoming(1, start=True, end=False, inputs=START))
        assert chunk is not None and answered is None
        live.write("cfm_solver_0", [1], cap=1)
    else:                  # a later chunk of a sequence the solver does not hold (admission: one it dropped)
        inputs, start = request_inputs(U, 10, 20, False), False
        admission.gone.mark(2, "it never started with a START request")
    _, by_solver = solver.admit(Incoming(2, start=start, end=False, inputs=inputs))
    by_admission = admission.check(2, start, False, inputs)
    assert by_admission.code == by_solver.code
    want = by_solver.answer
    if want.retry_after_s is not None:   # busy: each says when by its own count
        assert by_admission.answer.retry_after_s > 0
        want = dataclasses.replace(want, retry_after_s=by_admission.answer.retry_after_s)
    assert by_admission.answer == want and want.sequence == 2
    if name != "full":   # the same words after each model's name (the solver says more of why it holds none)
        mine, its = by_admission.error.removeprefix("admission: "), by_solver.error.removeprefix("cfm_solver: ")
        assert mine == its or name == "sequence not held" and its.startswith(mine), (mine, its)


def test_the_refusal_benchmark_refuses_alike_with_the_loads_answers_kept_and_priced_afresh(tmp_path):
    """``python -m s3flow_tools.measure.refusals``' in-process section times a burst both ways; both ways must
    refuse every START by capacity with the same words (it exits otherwise)."""
    from s3flow_tools.measure.refusals import refusal_cost

    cost = refusal_cost(tmp_path / "load", held=4, burst=5, rounds=2)
    assert sorted(cost) == ["afresh", "kept"] and all(len(v) == 10 for v in cost.values())
