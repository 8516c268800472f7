"""The streaming engine in process: chunks vs offline synthesis, batching, state lifecycle."""
import numpy as np
import pytest
import torch

from helpers import DropLog, make_engine, offline, small_flow, stream_in_process
from s3flow.engine.observer import Observers
from s3flow.serving.arrivals import MAX_TRANSIT_S
from s3flow.engine.sequences import DROP_REASONS, SequenceLimits, SequenceTable
from s3flow.engine.settings import SolverSettings
from s3flow.model.flow import synthesize
from s3flow.protocol import RequestError, RequestRules, ServerBusy, parse_request
from s3flow_client import chunk_schedule
from s3flow_client.demo import demo_utterance
from s3flow_contract.tensors import request_arrays
from s3flow.engine.planning import planned_calls
from s3flow.engine.streaming import StreamingEngine

#: the prefix re-run mode, whatever the server's default
PREFIX = SolverSettings.of(context_frames=-1, prompt_frames=-1)   # offline synthesis of each prefix


@pytest.mark.parametrize("meanflow", [False, True])
def test_each_chunk_equals_offline_synthesis_of_its_prefix(meanflow):
    """What a chunk returns is exactly what offline synthesis of the tokens so far (not finalised) gives
    for those frames: same noise, same trimming, offsets continue."""
    flow = small_flow(meanflow)
    u = demo_utterance(2.0, seed=3, noise_seed=5)
    sizes = [7, 13, 20, 10]
    [results] = stream_in_process(make_engine(flow, PREFIX), [u], [sizes])
    done = 0
    for k, res in enumerate(results):
        n = sum(sizes[:k + 1])
        final = k == len(sizes) - 1
        ref = offline(flow, u, n, finalize=final)
        assert res.frame_offset == done
        assert ref.shape[1] == (2 * n if final else 2 * n - 6)
        np.testing.assert_allclose(res.mel, ref[:, done:done + res.mel.shape[1]], atol=2e-4, rtol=0)
        done += res.mel.shape[1]
    assert done == 2 * len(u.speech_tokens)


def test_one_chunk_stream_equals_offline_exactly():
    flow = small_flow()
    u = demo_utterance(1.0, seed=1)
    [[res]] = stream_in_process(make_engine(flow, PREFIX), [u], [[len(u.speech_tokens)]])
    np.testing.assert_allclose(res.mel, offline(flow, u), atol=2e-4, rtol=0)


def test_prefix_mode_last_chunk_equals_whole_utterance_offline_and_earlier_chunks_do_not():
    """In prefix mode the last chunk solves the whole utterance, finalised: its frames are exactly offline
    synthesis of the whole utterance. Frames emitted earlier were made before later tokens existed, and the
    attention is global, so they differ (how much on a trained model: results/streaming.md)."""
    flow = small_flow()
    u = demo_utterance(3.0, seed=2)
    sizes = chunk_schedule(len(u.speech_tokens), 10, 2.0, 40)
    [results] = stream_in_process(make_engine(flow, PREFIX), [u], [sizes])
    ref = offline(flow, u)
    last = results[-1]
    np.testing.assert_allclose(last.mel, ref[:, last.frame_offset:], atol=2e-4, rtol=0)
    first = results[0]
    assert np.abs(first.mel - ref[:, :first.mel.shape[1]]).mean() > 1e-2


@pytest.mark.parametrize("context", [-1, 10])
def test_batched_chunks_equal_one_by_one(context):
    """Several utterances' chunks in one padded batch (different prompt and context lengths) give what
    each gives alone, in both streaming modes."""
    flow = small_flow()
    settings = SolverSettings.of(context_frames=context)
    utts = [demo_utterance(s, seed=i, noise_seed=10 + i, prompt_seconds=p)
            for i, (s, p) in enumerate([(1.2, 0.6), (2.0, 1.0), (0.8, 0.4), (1.6, 0.8)])]
    sizes = [chunk_schedule(len(u.speech_tokens), 5 + i, 2.0, 30) for i, u in enumerate(utts)]
    batched = stream_in_process(make_engine(flow, settings), utts, sizes)
    for u, s, got in zip(utts, sizes, batched):
        [alone] = stream_in_process(make_engine(flow, settings), [u], [s])
        for a, b in zip(got, alone):
            assert a.frame_offset == b.frame_offset
            np.testing.assert_allclose(a.mel, b.mel, atol=2e-4, rtol=0)


def test_same_seed_same_output_different_seed_different_output():
    flow = small_flow()
    u = demo_utterance(1.0, seed=1, noise_seed=3)
    v = demo_utterance(1.0, seed=1, noise_seed=4)
    a, b, c = (np.concatenate([r.mel for r in stream_in_process(make_engine(flow), [x], [[10, 15]])[0]], 1)
               for x in (u, u, v))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).mean() > 0.1


def test_guidance_and_steps_options_are_used():
    flow = small_flow()
    base = demo_utterance(1.0, seed=1)
    outs = []
    for steps, rate in [(None, None), (4, None), (None, 0.0)]:
        u = demo_utterance(1.0, seed=1)
        u.n_timesteps, u.guidance_rate = steps, rate
        engine = make_engine(flow)
        outs.append(np.concatenate([r.mel for r in stream_in_process(engine, [u], [[25]])[0]], 1))
        expected_calls = steps or 10
        assert engine.estimator_calls == expected_calls
    ref = offline(flow, base, n_steps=4)
    np.testing.assert_allclose(outs[1], ref, atol=2e-4)
    assert np.abs(outs[0] - outs[2]).mean() > 1e-3


def test_holdback_withholds_frames_until_the_next_chunk():
    flow = small_flow()
    u = demo_utterance(1.6, seed=1)
    [res] = stream_in_process(make_engine(flow, SolverSettings.of(holdback_frames=8)), [u], [[10, 10, 20]])
    assert [r.frame_offset for r in res] == [0, 14 - 8, 34 - 8]
    assert sum(r.mel.shape[1] for r in res) == 80


def test_unknown_sequence_and_state_lifecycle():
    flow = small_flow()
    engine = make_engine(flow, SolverSettings.of(max_live_sequences=2))
    u = demo_utterance(1.0, seed=1)
    rules = RequestRules()
    req = parse_request({"speech_tokens": u.speech_tokens[None, :5]}, start=False, end=False, rules=rules)
    with pytest.raises(RequestError, match="sequence 42 is not active"):
        engine.admit(42, req)
    stream_in_process(engine, [u], [[10, 15]])
    assert len(engine.sequences) == 0, "END drops the sequence's state"
    from helpers import request_inputs
    for cid in (1, 2):
        engine.admit(cid, parse_request(request_inputs(u, 0, 5, True), start=True, end=False, rules=rules))
    with pytest.raises(RequestError, match="too many live sequences"):
        engine.admit(3, parse_request(request_inputs(u, 0, 5, True), start=True, end=False, rules=rules))


def test_utterance_frame_limit_ends_a_prefix_mode_sequence_only():
    flow = small_flow()
    log = DropLog()
    engine = make_engine(flow, SolverSettings.of(max_utterance_frames=40, context_frames=-1), observer=log)
    u = demo_utterance(2.0, seed=1)
    from helpers import request_inputs
    rules = RequestRules()
    engine.run([engine.admit(1, parse_request(request_inputs(u, 0, 15, True), start=True, end=False,
                                              rules=rules))])
    with pytest.raises(RequestError, match="42 frames, above max_utterance_frames 40"):
        engine.admit(1, parse_request(request_inputs(u, 15, 21, False), start=False, end=False, rules=rules))
    assert 1 not in engine.sequences
    assert log.drops == [(1, "utterance too long")]
    bounded = make_engine(flow, SolverSettings.of(max_utterance_frames=40))   # bounded context: no cap
    bounded.run([bounded.admit(1, parse_request(request_inputs(u, 0, 15, True), start=True, end=False, rules=rules))])
    [res] = bounded.run([bounded.admit(1, parse_request(request_inputs(u, 15, 21, False), start=False, end=False,
                                                        rules=rules))])
    assert res.frame_offset + res.mel.shape[1] == 2 * 21 - 6 and 1 in bounded.sequences


def test_a_start_on_a_live_id_replaces_its_state_and_reports_the_drop_once_answered():
    flow = small_flow()
    log = DropLog()
    engine = make_engine(flow, observer=log)
    u = demo_utterance(1.0, seed=1)
    d = _Driver(engine, u, [10, 15])
    d.send(0)
    old = engine.sequences.peek(7)
    chunk = engine.admit(7, parse_request(d.inputs(0), start=True, end=False, rules=RequestRules()))
    assert chunk.replaced is old and engine.sequences.peek(7) is chunk.state is not old
    assert log.drops == [], "reported when the new START is answered, not before"
    [res] = engine.run([chunk])
    assert res.frame_offset == 0 and len(engine.sequences) == 1
    assert log.drops == [(7, "replaced by a new START")]


# ------------------------------------------------------------------------------- the sequence table


class _Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _table(max_live_sequences: int = 64, idle_timeout_s: float = 5.0):
    clock, log = _Clock(), DropLog()
    table = SequenceTable(SequenceLimits(max_live_sequences=max_live_sequences, idle_timeout_s=idle_timeout_s), log,
                          clock=clock)
    return table, clock, log


def _answered(table, corr_id, state):
    """A START whose chunk was answered: the state is live and not in flight."""
    table.begin(corr_id, state)
    table.commit(corr_id, end=False)


def test_idle_sequences_are_evicted():
    """Idle time counts from a sequence's last answer (commit); a later chunk answered refreshes it."""
    table, clock, log = _table(idle_timeout_s=5.0)
    one, two = object(), object()
    _answered(table, 1, one)
    _answered(table, 2, two)
    clock.now = 3.0
    assert table.serve(2) is two
    clock.now = 4.0
    table.commit(2, end=False)
    clock.now = 6.0
    assert table.evict_idle() == [1]
    assert 1 not in table and 2 in table and table.peek(2) is two
    clock.now = 8.9
    assert table.evict_idle() == [], "4.9 s since sequence 2's last answer"
    clock.now = 20.0
    assert table.evict_idle() == [2] and len(table) == 0
    assert log.drops == [(1, "idle"), (2, "idle")]
    with pytest.raises(RequestError, match="sequence 2 is not active: .* evicted after 5.0 s idle"):
        table.serve(2)


def _queue_table(tmp_path, slack_s: float = 1.0):
    """A table whose ``pending`` is the solver's (``OnTheWay`` over real ArrivalMarks files, as the served models
    share them; admission counts with ``seen.count``), one fake clock for both the idle time and the marks."""
    from s3flow.serving.arrivals import ArrivalMarks, OnTheWay

    clock, log = _Clock(), DropLog()
    seen = ArrivalMarks(tmp_path, clock=lambda: clock.now)
    on_the_way = OnTheWay(seen, slack_s=slack_s, wall=lambda: clock.now)
    table = SequenceTable(SequenceLimits(idle_timeout_s=5.0), Observers(log, on_the_way), clock=clock,
                          pending=on_the_way.pending)
    return table, clock, log, seen, on_the_way


def _started(table, seen, on_the_way, cid) -> None:
    """Admission lets a START through, the solver picks it up and answers it."""
    seen.count(cid, start=True)
    on_the_way.picked_up([(cid, True)])
    _answered(table, cid, object())


def test_a_sequence_whose_chunk_waits_in_the_queue_is_not_idle(tmp_path):
    """A request admission let through that the table has not picked up keeps the sequence from going idle
    however long it waits while the instance works through other requests, and whatever the order the hops
    between admission and the batcher bring requests in; once picked up and answered, idle time counts again."""
    table, clock, log, seen, on_the_way = _queue_table(tmp_path)
    for cid in (1, 2, 3):
        _started(table, seen, on_the_way, cid)
        clock.now += 0.1
    on_the_way.busy()                   # and works through other requests from here on
    clock.now = 1.0
    seen.count(2, start=False)          # sequence 2's next chunk passes admission, and is held up on its way
    clock.now = 4.0
    seen.count(3, start=False)          # 3's next chunk passed admission 3 s later, and overtakes it
    on_the_way.picked_up([(3, False)])
    table.serve(3)
    clock.now = 60.0
    assert table.evict_idle() == [1], "1 has nothing on its way; 2's chunk was let through 59 s ago, not yet here"
    on_the_way.picked_up([(2, False)])
    table.serve(2)                      # picked up at last ...
    table.commit(2, end=False)          # ... and answered: idle from here
    clock.now = 66.0
    assert table.evict_idle() == [2] and log.drops == [(1, "idle"), (2, "idle")]


def test_a_sequence_whose_end_is_on_its_way_at_overload_is_not_lost(tmp_path):
    """What lost 21 of 32 token2wav streams at once with admission off: a stream's next chunk passed admission
    right after its last answer, and sat behind the batcher's queue for more than the idle timeout, while the
    instance, busy all the time, picked up requests of other streams that admission had let through more than
    the slack later. Each picked-up request said "the older ones have come": they had not."""
    table, clock, log, seen, on_the_way = _queue_table(tmp_path)
    for cid in range(1, 9):
        _started(table, seen, on_the_way, cid)
    on_the_way.busy()
    clock.now = 0.5
    seen.count(1, start=False)          # stream 1's END, let through at 0.5 s
    for k in range(40):                 # 20 s of overload: other streams' chunks come and go, never a free instance
        clock.now = 1.0 + 0.5 * k
        cid = 2 + k % 7
        seen.count(cid, start=False)
        on_the_way.picked_up([(cid, False)])
        table.serve(cid)
        table.commit(cid, end=False)
        assert table.evict_idle() == [], f"at {clock.now} s"
    on_the_way.picked_up([(1, False)])  # stream 1's END reaches the instance at last, 20 s on
    table.serve(1)
    table.commit(1, end=True)
    assert 1 not in table and not log.drops


def test_a_chunk_picked_up_but_not_yet_served_keeps_its_sequence(tmp_path):
    """A FIFO execute takes a batch and serves its chunks one length bucket after another: a chunk already
    taken from Triton's queue but not yet in flight in the table counts as on its way until its execute is over
    (the reaper's thread runs beside it)."""
    table, clock, log, seen, on_the_way = _queue_table(tmp_path)
    _started(table, seen, on_the_way, 1)
    clock.now = 0.1
    seen.count(1, start=False)
    clock.now = 4.0
    on_the_way.busy()                   # the execute that holds it starts; other buckets first
    clock.now = 6.0
    assert table.evict_idle() == [], "taken from the queue, not yet served: not idle"
    table.serve(1)
    table.commit(1, end=False)
    on_the_way.picked_up([(1, False)])  # the execute is over
    on_the_way.free()
    clock.now = 11.5
    assert table.evict_idle() == [1]


def test_a_mark_whose_chunk_never_comes_keeps_nothing(tmp_path):
    """Issue 31: a client that goes between admission and the solver leaves a count whose request never reaches
    the solver (the ensemble stops at the cancellation). Once the instance has been free for the slack since the
    mark, or ``max_transit_s`` has passed (an instance that never idles), the count keeps nothing: the sequence
    goes ``idle_timeout_s`` after its last answer, as if it had not been counted."""
    table, clock, log, seen, on_the_way = _queue_table(tmp_path)
    for cid in (1, 2):
        _started(table, seen, on_the_way, cid)
    on_the_way.free()
    clock.now = 0.5
    seen.count(1, start=False)   # both clients go right after admission let their next chunk through
    seen.count(2, start=False)
    clock.now = 0.6
    assert table.evict_idle() == [] and on_the_way.pending(1), "on its way as far as anyone knows"
    on_the_way.busy()                      # the instance works on other streams: says nothing of 1, 2
    on_the_way.picked_up([(7, True)])
    seen.count(9, start=True)
    on_the_way.picked_up([(9, True)])   # nor does one admission let through later
    clock.now = 5.5
    assert table.evict_idle() == [] and on_the_way.pending(2)
    clock.now = 60.4
    assert on_the_way.pending(1), "within max_transit_s of its mark"
    clock.now = 60.6
    assert not on_the_way.pending(1), "max_transit_s after its mark with a busy instance: it is not coming"
    assert table.evict_idle() == [1, 2] and log.drops == [(1, "idle"), (2, "idle")]

    table, clock, log, seen, on_the_way = _queue_table(tmp_path / "idle")
    _started(table, seen, on_the_way, 4)
    on_the_way.free()
    clock.now = 2.0
    seen.count(4, start=False)          # its next chunk let through, then cancelled; nothing else happens
    clock.now = 2.9
    assert on_the_way.pending(4), "free since 0.0, but the mark (2.0) is within the slack of now"
    clock.now = 3.1
    assert not on_the_way.pending(4), "free for the slack after the mark: it would have come"
    assert table.evict_idle() == [], "its last answer is 3.1 s old"
    clock.now = 5.2
    assert table.evict_idle() == [4]


def test_a_token2wav_stream_is_idle_from_the_vocoders_answer_not_the_solvers(tmp_path):
    """What lost 18-24 of 32 token2wav streams at once even with every request counted: the solver answered a
    chunk, the vocoder's queue held that answer for over 5 s, the client (which sends its next chunk when it
    hears the answer) had nothing yet, and the solver took the stream for idle. ``Delivery`` keeps it until
    ``idle_s`` after the vocoder's answer."""
    from s3flow.serving.arrivals import ArrivalMarks, Delivery

    clock, log = _Clock(), DropLog()
    vocoded = ArrivalMarks(tmp_path / "vocoded", clock=lambda: clock.now)
    delivery = Delivery(vocoded, idle_s=5.0, wall=lambda: clock.now)
    table = SequenceTable(SequenceLimits(idle_timeout_s=5.0), Observers(log, delivery), clock=clock,
                          pending=delivery.pending)
    _answered(table, 1, object())
    delivery.answered(1, start=True)           # the START's mel goes on to the vocoder at 0 s
    _answered(table, 2, object())              # a token2mel stream: its answer is its client's
    clock.now = 5.1
    assert table.evict_idle() == [2], "the token2wav stream's answer is still in the vocoder's queue"
    clock.now = 8.0
    vocoded.count(1, start=True)               # the vocoder answers it: the client hears it now
    clock.now = 12.9
    assert table.evict_idle() == []
    clock.now = 13.1
    assert table.evict_idle() == [1] and log.drops == [(2, "idle"), (1, "idle")] and len(delivery) == 0

    _answered(table, 3, object())              # an id whose earlier life the vocoder counted up to 7
    for _ in range(7):
        vocoded.count(3, start=False)
    clock.now = 14.0
    delivery.answered(3, start=True)           # its new START: the old count says nothing of it
    clock.now = 30.0
    assert delivery.pending(3), "its START's answer is still on its way (within max_transit_s)"
    clock.now = 14.0 + MAX_TRANSIT_S + 0.1
    assert table.evict_idle() == [3], "an answer the vocoder never counts keeps the stream max_transit_s at most"


def test_an_answer_sent_to_a_vocoder_that_died_is_on_its_way_no_more(tmp_path):
    """Issue 53: the vocoder's stub died with a token2wav stream's answer; its client gave up (or resumed it
    elsewhere) and the healed server refused every new token2wav START busy for over 40 s, the solver holding and
    pricing the stream whose answer ``Delivery`` took for one still in the vocoder's queue (up to
    ``max_transit_s``). An answer sent on before the vocoder serving now was made is lost: the stream is idle as
    from the solver's answer, while one sent on after it is still on its way."""
    from s3flow.serving.arrivals import ArrivalMarks, Delivery

    clock, log, since = _Clock(), DropLog(), {"t": None}
    vocoded = ArrivalMarks(tmp_path / "vocoded", clock=lambda: clock.now)
    delivery = Delivery(vocoded, idle_s=5.0, wall=lambda: clock.now, vocoders_since=lambda: since["t"])
    table = SequenceTable(SequenceLimits(idle_timeout_s=5.0), Observers(log, delivery), clock=clock,
                          pending=delivery.pending)
    _answered(table, 1, object())
    delivery.answered(1, start=True)      # at 0 s its mel goes on to the vocoder, whose stub dies with it
    clock.now = 5.1
    assert table.evict_idle() == [], "no vocoder reports yet (it is being reloaded): still on its way"
    since["t"] = 1.5                      # the reloaded vocoder's report: made at 1.5 s
    _answered(table, 2, object())
    delivery.answered(2, start=True)      # a stream started on the healed server at 5.1 s
    assert table.evict_idle() == [1] and log.drops == [(1, "idle")]
    clock.now = 10.3
    assert table.evict_idle() == [] and delivery.pending(2), "sent on to the vocoder serving now: on its way"


def test_an_answer_the_ensemble_dropped_is_on_its_way_no_more_once_the_vocoder_was_free(tmp_path):
    """A token2wav client killed while its chunk was in the solver: the solver's answer goes into a cancelled
    ensemble request, which never calls the vocoder, so the vocoder never counts it. Once the vocoder holding the
    stream has been seen free ``slack_s`` after the answer was sent, the answer is not coming and the stream is
    idle as from that answer; the vocoder seen free only before then (busy since) says nothing. Before, the
    stream was held ``max_transit_s`` (60 s): tests/test_vocoder.py's killed-client test failed 1 run in 3."""
    from s3flow.serving.arrivals import ArrivalMarks, Delivery

    clock, log, free = _Clock(), DropLog(), {"at": 0.0}
    vocoded = ArrivalMarks(tmp_path / "vocoded", clock=lambda: clock.now)
    delivery = Delivery(vocoded, idle_s=5.0, wall=lambda: clock.now, vocoder_free_at=lambda corr_id: free["at"],
                        slack_s=1.0)
    table = SequenceTable(SequenceLimits(idle_timeout_s=5.0), Observers(log, delivery), clock=clock,
                          pending=delivery.pending)
    _answered(table, 1, object())
    delivery.answered(1, start=True)
    clock.now = 0.5
    vocoded.count(1, start=True)             # its first answer vocoded at 0.5 s
    clock.now = 2.0
    delivery.answered(1, start=False)        # the second answer, into an ensemble whose client was killed
    free["at"] = 2.9                         # the vocoder free at 2.9 s, busy since: within the slack
    clock.now = 6.0
    assert table.evict_idle() == [], "the vocoder was free only 0.9 s after the answer: it may still come"
    free["at"] = 3.1                         # seen free at 3.1 s: it would have taken the answer by then
    clock.now = 6.9
    assert delivery.pending(1) and table.evict_idle() == [], "idle as from the dropped answer: 4.9 s"
    clock.now = 7.1
    assert not delivery.pending(1) and table.evict_idle() == [1] and log.drops == [(1, "idle")]


def test_a_restarted_or_ended_sequence_counts_from_its_start(tmp_path):
    """A START counts from 1 on both sides (a restart on a live id, a resume), so an earlier life's requests
    never look like one on its way; an END forgets the instance's count with the state."""
    table, clock, log, seen, on_the_way = _queue_table(tmp_path)
    _started(table, seen, on_the_way, 5)
    for _ in range(3):
        seen.count(5, start=False)
        on_the_way.picked_up([(5, False)])
    assert not on_the_way.pending(5)
    _started(table, seen, on_the_way, 5)            # a new START on the same id
    assert seen.counted(5)[0] == 1 and not on_the_way.pending(5)
    table.serve(5)
    table.commit(5, end=True)
    assert len(on_the_way) == 0, "the END took the instance's count with the state"


def test_a_sequence_in_flight_is_never_evicted_however_long_it_takes():
    """Begun (a START) or served (a later chunk) and not yet committed or rolled back: the chunk is being
    solved, and the idle reaper leaves it alone however long that takes; its idle time starts at the answer."""
    table, clock, log = _table(idle_timeout_s=5.0)
    started, served = object(), object()
    table.begin(1, started)                  # a START being solved
    _answered(table, 2, served)
    table.serve(2)                           # a later chunk being solved
    for t in (5.1, 60.0, 3600.0):
        clock.now = t
        assert table.evict_idle() == [] and 1 in table and 2 in table
    assert table.next_eviction_s() == pytest.approx(5.0 + 0.1), "nothing idle: a whole timeout at least"
    table.commit(1, end=False)
    clock.now = 3602.0
    table.commit(2, end=False)
    assert table.next_eviction_s() == pytest.approx(3.0 + 0.1), "sequence 1 answered 2 s ago"
    clock.now = 3605.5
    assert table.evict_idle() == [1] and 2 in table
    clock.now = 3607.5
    assert table.evict_idle() == [2] and len(table) == 0
    assert log.drops == [(1, "idle"), (2, "idle")]


def test_a_chunk_being_solved_is_not_evicted_by_a_reaper_running_meanwhile():
    """The engine's chunk is in flight from admit to the end of run: an idle reaper running during a very
    slow solve (here 100 s per Euler step) does not take its state, and the sequence goes on."""
    from helpers import torch_encoder
    from s3flow.engine.streaming import StreamingEngine
    from s3flow.model.flow import TorchEstimator
    flow = small_flow()
    table, clock, log = _table(idle_timeout_s=5.0)
    inner, reaped = TorchEstimator(flow.estimator), []

    def slow(inputs):
        clock.now += 100.0
        reaped.extend(table.evict_idle())
        return inner(inputs)

    engine = StreamingEngine(torch_encoder(flow), slow, n_feats=80, meanflow=False, table=table)
    assert engine.sequences is table
    u = demo_utterance(1.0, seed=1, noise_seed=3)
    u.n_timesteps = 3
    sizes = [10, 10, 5]
    [undisturbed] = stream_in_process(make_engine(flow), [u], [sizes])
    d = _Driver(engine, u, sizes)
    got = [d.send(0)]                        # a START: 300 s in flight
    assert reaped == [] and 7 in table
    clock.now += 4.0
    assert table.evict_idle() == [], "4 s after its answer"
    got.append(d.send(1))                    # a later chunk: 300 s more
    assert reaped == [] and 7 in table
    got.append(d.send(2))                    # END
    assert reaped == [] and len(table) == 0 and log.drops == []
    for a, b in zip(got, undisturbed):
        assert a.frame_offset == b.frame_offset
        np.testing.assert_array_equal(a.mel, b.mel)


def test_rollback_of_a_start_restores_the_state_it_replaced():
    table, clock, log = _table()
    old, new = object(), object()
    _answered(table, 1, old)
    clock.now = 2.0
    assert table.begin(1, new) is old and table.peek(1) is new
    table.rollback(1, old, started=True)
    assert table.peek(1) is old and len(table) == 1
    # a START on a fresh id leaves nothing behind; a later chunk's state stays as it was
    assert table.begin(2, object()) is None
    table.rollback(2, None, started=True)
    assert 2 not in table and len(table) == 1
    assert table.serve(1) is old
    table.rollback(1, None, started=False)
    assert table.peek(1) is old
    # rolled back, neither is in flight any more: the restored state goes idle like any other
    clock.now = 7.5
    assert table.evict_idle() == [1] and len(table) == 0
    assert log.drops == [(1, "idle")], "a rollback drops nothing the client had"


def test_end_drops_a_state_with_a_known_reason_only():
    table, clock, log = _table()
    state = object()
    _answered(table, 1, state)
    with pytest.raises(ValueError, match="unknown drop reason 'bored'"):
        table.end(1, "bored")
    assert table.peek(1) is state and log.drops == [], "an unknown reason drops nothing"
    assert table.end(1, "cancelled") is True and 1 not in table
    assert table.end(1, "cancelled") is False, "nothing left to drop"
    assert table.end(9, "error") is False
    assert log.drops == [(1, "cancelled")]
    # a state in flight can be ended too (the engine ends a chunk's sequence that grew too long)
    table.begin(2, object())
    assert table.end(2, "utterance too long") is True and 2 not in table
    assert log.drops == [(1, "cancelled"), (2, "utterance too long")]
    assert {"idle", "cancelled", "utterance too long"} <= set(DROP_REASONS)


def test_drops_are_reported_to_the_observer_with_their_reason_and_ends_are_not():
    table, clock, log = _table(idle_timeout_s=5.0)
    for cid in (1, 2, 3, 4):
        _answered(table, cid, object())
    table.serve(1)
    table.commit(1, end=True)                # END answered: not a drop
    table.end(2, "invalid END request")
    table.begin(5, object())
    table.rollback(5, None, started=True)    # a failed START: the session reports it, not the table
    clock.now = 6.0
    assert sorted(table.evict_idle()) == [3, 4]
    assert log.drops == [(2, "invalid END request"), (3, "idle"), (4, "idle")]
    assert len(table) == 0


def test_a_full_table_refuses_a_start_saying_when_a_slot_frees_but_takes_a_restart():
    table, clock, log = _table(max_live_sequences=2, idle_timeout_s=5.0)
    one, two = object(), object()
    _answered(table, 1, one)
    clock.now = 1.0
    _answered(table, 2, two)
    clock.now = 2.0
    with pytest.raises(ServerBusy, match=r"too many live sequences \(2, max_live_sequences 2\); retry in 3.1 s") \
            as info:
        table.begin(3, object())
    assert info.value.retry_after_s == pytest.approx(3.1) and 3 not in table and len(table) == 2
    restart = object()
    assert table.begin(2, restart) is two, "a START on a live id replaces it, full or not"
    assert table.peek(2) is restart and len(table) == 2 and table.peek(1) is one


# ------------------------------------------------------------------------------- bounded context


def _offline_window(flow, u, prompt_frames_ctx, c0, e, n, final, prompt_used=None):
    """Offline synthesis of a bounded-context chunk as an independent call: the prompt's last ``prompt_used``
    frames (all by default) extended by the context (tokens [c0/2, e/2) and their emitted mel), speech tokens
    [e/2, n), the same starting point (the prompt region's noise of those prompt frames)."""
    from s3flow.model.solver import FrameNoise
    tp = u.prompt_mel.shape[0]
    used = tp if prompt_used is None else prompt_used
    ctx_tokens = u.speech_tokens[c0 // 2:e // 2]
    prompt_tokens = np.concatenate([u.prompt_tokens[(tp - used) // 2:], ctx_tokens])
    prompt_feat = np.concatenate([u.prompt_mel[tp - used:], prompt_frames_ctx.T], axis=0)  # frames-major
    noise = FrameNoise(u.seed, 80)
    g = 2 * n if final else 2 * n - 6
    z = np.concatenate([noise.prompt(tp)[:, tp - used:], noise.frames(c0, g)], axis=1)
    return synthesize(flow, torch.from_numpy(u.speech_tokens[e // 2:n])[None], torch.from_numpy(prompt_tokens)[None],
                      torch.from_numpy(prompt_feat)[None], torch.from_numpy(u.speaker_embedding)[None],
                      finalize=final, z=torch.from_numpy(z)[None]).mel[0].numpy()


@pytest.mark.parametrize("meanflow", [False, True])
def test_bounded_context_chunk_equals_offline_synthesis_with_the_context_as_prompt(meanflow):
    """A bounded-context chunk is offline synthesis with prompt := prompt ++ the last C emitted frames
    (their tokens and mel) and the chunk's tokens, from the same frame noise."""
    from helpers import offline
    flow = small_flow(meanflow)
    u = demo_utterance(2.4, seed=4, noise_seed=6)
    sizes, context = [8, 12, 20, 20], 16
    [results] = stream_in_process(make_engine(flow, SolverSettings.of(context_frames=context)), [u], [sizes])
    emitted = np.zeros((80, 0), np.float32)
    for k, res in enumerate(results):
        n, final, e = sum(sizes[:k + 1]), k == len(sizes) - 1, emitted.shape[1]
        assert res.frame_offset == e
        c0 = max(0, e - context) // 2 * 2
        if k == 0:  # nothing emitted yet: exactly prefix mode's first chunk
            np.testing.assert_allclose(res.mel, offline(flow, u, n, finalize=False), atol=2e-4, rtol=0)
        ref = _offline_window(flow, u, emitted[:, c0:e], c0, e, n, final)
        np.testing.assert_allclose(res.mel, ref[:, :res.mel.shape[1]], atol=2e-4, rtol=0)
        emitted = np.concatenate([emitted, res.mel], axis=1)
    assert emitted.shape[1] == 2 * len(u.speech_tokens)


@pytest.mark.parametrize("cap,slide", [(20, 0), (0, 0), (200, 1), (20, 1), ("served default", 0)])
def test_a_capped_or_sliding_prompt_chunk_equals_offline_synthesis_with_its_stated_conditioning(cap, slide):
    """prompt_frames P keeps the prompt's last P frames on every chunk; slide_prompt makes the conditioning the
    last C frames of prompt ++ emitted mel. Either way a chunk is offline synthesis with that conditioning.
    "served default": the default settings (the prompt's last 50 frames) on a 2 s prompt, what they promise."""
    from s3flow.engine.settings import ChunkSolving
    flow = small_flow()
    default = cap == "served default"
    u = demo_utterance(2.4, seed=4, noise_seed=6, prompt_seconds=2.0 if default else 1.0)
    tp = u.prompt_mel.shape[0]
    sizes, context = [8, 12, 20, 20], 16
    if default:
        cap = ChunkSolving().prompt_frames
        assert 0 < cap < tp, "the default caps a 2 s prompt"
        settings = SolverSettings.of(context_frames=context)
    else:
        settings = SolverSettings.of(context_frames=context, prompt_frames=cap, slide_prompt=slide)
    [results] = stream_in_process(make_engine(flow, settings), [u], [sizes])
    emitted, used_by_chunk = np.zeros((80, 0), np.float32), []
    for k, res in enumerate(results):
        n, final, e = sum(sizes[:k + 1]), k == len(sizes) - 1, emitted.shape[1]
        c0 = max(0, e - context) // 2 * 2
        used = min(tp, cap)
        if slide:
            used = min(used, max(0, context - (e - c0)) // 2 * 2)
        used_by_chunk.append(used)
        ref = _offline_window(flow, u, emitted[:, c0:e], c0, e, n, final, prompt_used=used)
        np.testing.assert_allclose(res.mel, ref[:, :res.mel.shape[1]], atol=2e-4, rtol=0)
        emitted = np.concatenate([emitted, res.mel], axis=1)
    assert emitted.shape[1] == 2 * len(u.speech_tokens)
    if slide:
        assert used_by_chunk[0] == min(tp, cap, context) and used_by_chunk[-1] < used_by_chunk[0], used_by_chunk
    else:
        assert set(used_by_chunk) == {min(tp, cap)}, used_by_chunk


def test_a_sliding_prompt_makes_a_chunks_cost_independent_of_the_prompt_length():
    """Planned estimator frames per chunk: with the whole prompt a 10 s prompt adds 450 frames to every chunk
    over a 1 s one; sliding, the two cost the same once the window is full, and the first chunk pays at most
    the window."""
    chunks = [10, 20, 40, 80, 100, 100]
    def frames(prompt_tokens, **kw):
        return [f for _, f in planned_calls(8, prompt_tokens, chunks, 100, steps=1, **kw)]
    whole_short, whole_long = frames(25), frames(250)
    assert [b - a for a, b in zip(whole_short, whole_long)] == [450] * len(chunks)
    slide_short, slide_long = frames(25, slide_prompt=1, prompt_frames=100), frames(250, slide_prompt=1, prompt_frames=100)
    assert slide_long[0] == 100 + 2 * 10 - 6 and slide_long[3:] == slide_short[3:], (slide_short, slide_long)
    assert sum(slide_long) < 0.35 * sum(whole_long), (sum(slide_long), sum(whole_long))


def test_bounded_context_cost_per_chunk_does_not_grow_with_the_utterance():
    flow = small_flow()
    u = demo_utterance(8.0, seed=2)
    sizes = [10] + [19] * 10
    u.n_timesteps = 1
    costs = {}
    for context in (-1, 24):
        engine = make_engine(flow, SolverSettings.of(context_frames=context))
        per_chunk, last = [], 0
        driver = _Driver(engine, u, sizes)
        for k in range(len(sizes)):
            driver.send(k)
            per_chunk.append(engine.solved_frames - last)
            last = engine.solved_frames
        costs[context] = per_chunk
    prefix, bounded = costs[-1], costs[24]
    # prompt 50 + context <= 25 + 38 new + 6 re-solved lookahead frames, whatever the position
    assert max(bounded[1:]) <= 50 + 25 + 38 + 6 and bounded[2] == bounded[-2], bounded
    assert prefix[-1] > 2.5 * prefix[2], prefix
    assert sum(bounded) < 0.5 * sum(prefix), (sum(bounded), sum(prefix))


class _Driver:
    """Send one utterance's chunks one call at a time (the engine API a Triton execute uses)."""

    def __init__(self, engine, u, sizes):
        self.engine, self.u, self.sizes = engine, u, sizes

    def inputs(self, k):
        from helpers import request_inputs
        lo = sum(self.sizes[:k])
        return request_inputs(self.u, lo, lo + self.sizes[k], k == 0)

    def send(self, k, cid=7):
        end = k == len(self.sizes) - 1
        req = parse_request(self.inputs(k), start=k == 0, end=end, rules=RequestRules())
        return self.engine.run([self.engine.admit(cid, req)])[0]


class _FailingEstimator:
    def __init__(self, inner):
        self.inner, self.fail = inner, False

    def __call__(self, inputs):
        if self.fail:
            raise RuntimeError("estimator went away")
        return self.inner(inputs)


@pytest.mark.parametrize("context", [-1, 12])
def test_a_failed_chunk_leaves_the_state_as_before_and_a_retry_continues_exactly(context):
    from helpers import torch_encoder
    from s3flow.model.flow import TorchEstimator
    from s3flow.engine.streaming import StreamingEngine
    flow = small_flow()
    u = demo_utterance(1.6, seed=8, noise_seed=2)
    u.n_timesteps = 3
    sizes = [10, 12, 18]
    settings = SolverSettings.of(context_frames=context, holdback_frames=3)
    [undisturbed] = stream_in_process(make_engine(flow, settings), [u], [sizes])
    est = _FailingEstimator(TorchEstimator(flow.estimator))
    engine = StreamingEngine(torch_encoder(flow), est, n_feats=80, meanflow=False, solving=settings.solving,
                             limits=settings.sequences)
    d = _Driver(engine, u, sizes)
    got = [d.send(0)]
    state = engine.sequences.peek(7)
    before = (state.tokens.copy(), state.noised_mels.values.copy(), state.noised_mels.start, state.emitted,
              None if state.mel_tail is None else state.mel_tail.copy())
    est.fail = True
    with pytest.raises(RuntimeError, match="went away"):
        d.send(1)
    after = engine.sequences.peek(7)
    assert after is state and np.array_equal(after.tokens, before[0]) and after.emitted == before[3]
    assert np.array_equal(after.noised_mels.values, before[1]) and after.noised_mels.start == before[2]
    assert (after.mel_tail is None and before[4] is None) or np.array_equal(after.mel_tail, before[4])
    est.fail = False
    got += [d.send(1), d.send(2)]
    assert [r.frame_offset for r in got] == [r.frame_offset for r in undisturbed]
    for a, b in zip(got, undisturbed):
        np.testing.assert_array_equal(a.mel, b.mel)
    # a START whose solve fails leaves no state behind
    est.fail = True
    with pytest.raises(RuntimeError):
        d.send(0, cid=8)
    assert 8 not in engine.sequences


def test_a_bounded_context_stream_keeps_constant_state_and_has_no_length_cap():
    """Streams of any length: in bounded-context mode the state a sequence keeps (tokens, mel tail, noised
    mels) stays the same size chunk after chunk, however long the utterance grows, and max_utterance_frames
    does not end it (it caps the prefix mode only)."""
    from s3flow.engine.settings import ChunkSolving

    calls = []

    def encode(tokens, token_len, embedding):
        b, t = tokens.shape[0], 2 * tokens.shape[1]
        return torch.zeros(b, 80, t), None, torch.zeros(b, 80)

    def estimate(inputs):
        calls.append(inputs.x.shape[2])
        return torch.zeros_like(inputs.x)

    solving = ChunkSolving(context_frames=100, max_utterance_frames=300)
    engine = StreamingEngine(encode, estimate, n_feats=80, meanflow=False, solving=solving)
    u = demo_utterance(1.0, seed=3)
    rng = np.random.default_rng(0)
    sizes, offsets = [], []
    for k in range(60):   # 60 chunks of 50 tokens: 6000 frames, 20x the cap
        tokens = rng.integers(0, 6561, 50)
        inputs = request_arrays(tokens, start=k == 0, **(dict(prompt_tokens=u.prompt_tokens, prompt_mel=u.prompt_mel,
                                                             speaker_embedding=u.speaker_embedding,
                                                             n_timesteps=1) if k == 0 else {}))
        req = parse_request(inputs, start=k == 0, end=k == 59, rules=RequestRules(), n_feats=80)
        [res] = engine.run([engine.admit(1, req)])
        offsets.append((res.frame_offset, res.mel.shape[1]))
        s = engine.sequences.peek(1)
        if s is not None:
            sizes.append((s.tokens.size, s.mel_tail.shape[1], s.noised_mels.values.shape[1]))
    assert sizes[5:] == [sizes[5]] * len(sizes[5:]), "the state stops growing once the context is full"
    assert max(t for t, _, _ in sizes) <= 100 // 2 + 2 + 50 + 3, sizes[-1]
    assert offsets[0][0] == 0 and all(o + n == nxt for (o, n), (nxt, _) in zip(offsets, offsets[1:]))
    assert sum(n for _, n in offsets) == 2 * 50 * 60
    # a chunk's solve does not grow with the utterance (the END chunk adds only its 6 lookahead frames)
    assert max(calls[:-1]) == max(calls[20:30]) and max(calls) <= max(calls[20:30]) + 6, calls
