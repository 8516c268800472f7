"""The solver's session layer (s3flow.serving.session) with a fake model: slots, errors, codes, drops, retries."""
import numpy as np
import pytest
import torch

from helpers import DropLog, request_inputs
from s3flow.engine.observer import NO_OBSERVER
from s3flow.engine.settings import SolverSettings
from s3flow.serving.local_stream import stream_in_process
from s3flow.serving.incoming import Incoming
from s3flow.serving.session import ModelCallError, SolverSession
from s3flow.serving.responses import CANCELLED, INTERNAL, INVALID_ARG, UNAVAILABLE
from s3flow.engine.streaming import StreamingEngine
from s3flow_client.demo import demo_utterance

N_FEATS = 80


class FakeModels:
    """An encoder whose mu is the token id over two frames, and an estimator with velocity mu - x; either
    can be told to fail."""

    def __init__(self):
        self.fail = False
        self.bug = False
        self.calls = 0

    def encode(self, tokens, token_len, emb):
        if self.fail:
            raise ModelCallError("model 'flow_encoder' failed: unavailable")
        if self.bug:
            raise RuntimeError("shape mismatch")
        mu = tokens.float().repeat_interleave(2, dim=1)[:, None, :].expand(-1, N_FEATS, -1) / 1000
        return mu, None, torch.zeros(tokens.shape[0], N_FEATS)

    def estimate(self, inputs):
        self.calls += 1
        return inputs.mu - inputs.x


def session(settings=SolverSettings(), drops=None):
    """A session over the fake models; ``drops`` (a list) receives each dropped sequence as (corr_id, reason),
    as the engine's observer hears of it."""
    models = FakeModels()
    observer = NO_OBSERVER if drops is None else DropLog(drops)
    engine = StreamingEngine(models.encode, models.estimate, n_feats=N_FEATS, meanflow=False,
                             solving=settings.solving, limits=settings.sequences, observer=observer)
    return SolverSession(engine, settings.rules), models


def chunk(u, cid, lo, hi, start=False, end=False, **kw):
    return Incoming(corr_id=cid, start=start, end=end, inputs=request_inputs(u, lo, hi, start), **kw)


U = demo_utterance(1.0, seed=1)


def test_a_stream_of_chunks_gives_consecutive_frames_and_end_drops_the_state():
    s, _ = session()
    outs = [s.handle([chunk(U, 1, 0, 10, start=True)]), s.handle([chunk(U, 1, 10, 25, end=True)])]
    assert [o[0].result.frame_offset for o in outs] == [0, 14]
    assert sum(o[0].result.mel.shape[1] for o in outs) == 50 and s.live == 0


def test_empty_slots_get_an_empty_outcome_and_do_not_reach_the_engine():
    s, models = session()
    [o] = s.handle([Incoming(corr_id=0, start=False, end=False, inputs={}, ready=False)])
    assert o.result is None and o.error is None and models.calls == 0


def test_a_bad_request_is_invalid_arg_naming_the_sequence_and_the_others_in_the_batch_go_on():
    s, _ = session()
    bad = chunk(U, 2, 0, 5, start=True)
    bad.inputs["speech_tokens"] = np.array([[1, 7000]], np.int64)
    out = s.handle([chunk(U, 1, 0, 10, start=True), bad])
    assert out[0].result is not None and out[0].result.mel.shape == (N_FEATS, 14)
    assert out[1].code == INVALID_ARG and out[1].error == "sequence 2: speech_tokens must be in [0, 6561), got 7000"
    [late] = s.handle([chunk(U, 9, 0, 5)])
    assert late.code == INVALID_ARG and late.error.startswith("sequence 9 is not active")


def test_an_invalid_end_request_drops_the_sequence():
    drops = []
    s, _ = session(drops=drops)
    s.handle([chunk(U, 1, 0, 10, start=True)])
    bad = chunk(U, 1, 10, 12, end=True)
    bad.inputs["speech_tokens"] = bad.inputs["speech_tokens"].astype(np.int32)
    [o] = s.handle([bad])
    assert o.code == INVALID_ARG and "speech_tokens must be int64, got int32" in o.error
    assert s.live == 0 and drops == [(1, "invalid END request")]


def test_a_failed_model_call_is_unavailable_and_the_chunk_can_be_sent_again():
    drops = []
    s, models = session(drops=drops)
    ref, _ = session()
    first = s.handle([chunk(U, 1, 0, 10, start=True)])[0].result
    ref.handle([chunk(U, 1, 0, 10, start=True)])
    models.fail = True
    [o] = s.handle([chunk(U, 1, 10, 20)])
    assert o.code == UNAVAILABLE and "flow_encoder" in o.error and "send it again" in o.error
    assert s.live == 1 and drops == []
    models.fail = False
    [again] = s.handle([chunk(U, 1, 10, 20)])
    [want] = ref.handle([chunk(U, 1, 10, 20)])
    assert first.frame_offset == 0 and again.result.frame_offset == want.result.frame_offset == 14
    np.testing.assert_array_equal(again.result.mel, want.result.mel)


def test_a_failed_end_or_start_chunk_drops_the_sequence_and_says_so():
    drops = []
    s, models = session(drops=drops)
    s.handle([chunk(U, 1, 0, 10, start=True)])
    models.fail = True
    [end] = s.handle([chunk(U, 1, 10, 20, end=True)])
    [start] = s.handle([chunk(U, 2, 0, 10, start=True)])
    assert end.code == start.code == UNAVAILABLE
    assert "restart the utterance" in end.error and "send the START again" in start.error
    assert s.live == 0 and drops == [(1, "failed END"), (2, "failed START")]


def test_a_failed_restart_puts_the_live_utterance_back():
    s, models = session()
    s.handle([chunk(U, 1, 0, 10, start=True)])
    before = s.engine.sequences.peek(1)
    models.fail = True
    [o] = s.handle([chunk(U, 1, 0, 10, start=True)])
    assert o.code == UNAVAILABLE and s.engine.sequences.peek(1) is before


def test_a_start_on_a_live_id_restarts_the_utterance_and_is_counted():
    drops = []
    s, _ = session(drops=drops)
    s.handle([chunk(U, 1, 0, 10, start=True)])
    [again] = s.handle([chunk(U, 1, 0, 10, start=True)])
    assert again.result.frame_offset == 0 and s.live == 1
    assert drops == [(1, "replaced by a new START")]


def test_any_other_failure_is_internal_and_ends_the_sequence():
    drops = []
    s, models = session(drops=drops)
    s.handle([chunk(U, 1, 0, 10, start=True)])
    models.bug = True
    [o] = s.handle([chunk(U, 1, 10, 20)])
    assert o.code == INTERNAL and "RuntimeError: shape mismatch" in o.error and "ended" in o.error
    assert s.live == 0 and drops == [(1, "error")]


def test_cancelled_batch_stops_before_a_step_and_drops_the_state():
    drops = []
    s, models = session(drops=drops)
    s.handle([chunk(U, 1, 0, 10, start=True)])
    calls = models.calls
    [o] = s.handle([chunk(U, 1, 10, 20, is_cancelled=lambda: True)])
    assert o.code == CANCELLED and "cancelled by the client before its last Euler step" in o.error
    assert models.calls == calls and s.live == 0 and drops == [(1, "cancelled")]


def test_a_cancelled_request_among_live_ones_rides_along_then_is_dropped():
    drops = []
    s, _ = session(drops=drops)
    s.handle([chunk(U, 1, 0, 10, start=True), chunk(U, 2, 0, 10, start=True)])
    out = s.handle([chunk(U, 1, 10, 20, is_cancelled=lambda: True), chunk(U, 2, 10, 20)])
    assert all(o.result is not None for o in out)
    assert drops == [(1, "cancelled")] and s.live == 1


def test_idle_sequences_are_evicted_with_a_reason():
    now = [0.0]
    drops = []
    s, _ = session(SolverSettings.of(idle_timeout_s=5.0), drops=drops)
    s.engine.sequences.clock = lambda: now[0]
    s.handle([chunk(U, 1, 0, 10, start=True)])
    now[0] = 6.0
    assert s.evict_idle() == [1] and drops == [(1, "idle")]
    [o] = s.handle([chunk(U, 1, 10, 20)])
    assert o.code == INVALID_ARG and "evicted after 5.0 s idle" in o.error


@pytest.mark.parametrize("context", [-1, 0, 6])
def test_every_frame_arrives_once_in_order_in_each_mode(context):
    s, _ = session(SolverSettings.of(context_frames=context, holdback_frames=5))
    u = demo_utterance(2.0, seed=3)
    sizes, done, lo = [3, 7, 11, 9, 20], 0, 0
    for k, n in enumerate(sizes):
        [o] = s.handle([chunk(u, 4, lo, lo + n, start=k == 0, end=k == len(sizes) - 1)])
        assert o.result.frame_offset == done
        done += o.result.mel.shape[1]
        lo += n
    assert done == 2 * len(u.speech_tokens) and s.live == 0


def test_a_full_server_refuses_a_start_at_once_as_unavailable_saying_when_to_send_it_again():
    now = [100.0]
    s, _ = session(SolverSettings.of(max_live_sequences=2, idle_timeout_s=5.0))
    s.engine.sequences.clock = lambda: now[0]
    s.handle([chunk(U, 1, 0, 10, start=True)])
    now[0] += 2.0
    s.handle([chunk(U, 2, 0, 10, start=True)])
    [full] = s.handle([chunk(U, 3, 0, 10, start=True)])
    assert full.code == UNAVAILABLE and full.result is None
    # sequence 1 was last answered 2 s ago: it goes idle in 3 s (+0.1 s margin)
    assert full.error == ("cfm_solver: sequence 3: too many live sequences (2, max_live_sequences 2); "
                          "retry in 3.1 s")
    now[0] += 3.2
    [later] = s.handle([chunk(U, 3, 0, 10, start=True)])  # the idle one is evicted first: room again
    assert later.result is not None and s.live == 2


def test_cancel_ends_a_live_sequence_at_once_and_reports_it():
    drops = []
    s, _ = session(drops=drops)
    s.handle([chunk(U, 1, 0, 10, start=True)])
    assert s.cancel(1) is True and s.live == 0 and drops == [(1, "cancelled")]
    assert s.cancel(1) is False and s.cancel(2) is False and drops == [(1, "cancelled")], "nothing to end"
    [o] = s.handle([chunk(U, 1, 10, 20)])
    assert o.code == INVALID_ARG and o.error.startswith("sequence 1 is not active")


def test_stream_in_process_streams_one_utterance_as_a_client_would():
    s, _ = session()
    by_hand, _ = session()
    want = [by_hand.handle([chunk(U, 1, 0, 10, start=True)])[0].result,
            by_hand.handle([chunk(U, 1, 10, 25, end=True)])[0].result]
    start = dict(prompt_tokens=U.prompt_tokens, prompt_mel=U.prompt_mel, speaker_embedding=U.speaker_embedding,
                 seed=U.seed, n_timesteps=U.n_timesteps, guidance_rate=U.guidance_rate)
    got = stream_in_process(s, U.speech_tokens, [10, 15], corr_id=3, **start)
    assert [r.frame_offset for r in got.results] == [0, 14] and got.seams == [14]
    assert got.mel.shape == (N_FEATS, 50) and len(got.latencies_s) == 2 and s.live == 0
    np.testing.assert_array_equal(got.mel, np.concatenate([r.mel for r in want], axis=1))
    # end=False: the sequence stays live until cancelled
    stream_in_process(s, U.speech_tokens, [10, 5], corr_id=4, end=False, **start)
    assert s.live == 1 and s.cancel(4) and s.live == 0
    s.draining = lambda: True
    with pytest.raises(RuntimeError, match=r"chunk 0 \(10 tokens\) was refused: .*draining"):
        stream_in_process(s, U.speech_tokens, [10, 15], corr_id=5, **start)


def test_a_draining_server_refuses_new_sequences_and_serves_the_ones_it_holds():
    draining = [False]
    s, _ = session()
    s.draining = lambda: draining[0]
    s.handle([chunk(U, 1, 0, 10, start=True)])
    draining[0] = True
    new, old = s.handle([chunk(U, 2, 0, 10, start=True), chunk(U, 1, 10, 25, end=True)])
    assert new.code == UNAVAILABLE and "draining" in new.error and "send the START to another server" in new.error
    assert old.result is not None and old.result.frame_offset == 14 and s.live == 0


# ------------------------------------------------------------------------------------------- dispositions
def _unknown_voice(voice_id, tenant=""):
    from s3flow.serving.voice_registry import UnknownVoice
    raise UnknownVoice(f"voice_id {voice_id} is not registered on this server")


def _row(name):
    """(outcome, expected disposition, expected retry_after_s) of one row of the session's failure table."""
    from s3flow_contract.tensors import request_arrays
    now = [100.0]
    s, models = session(SolverSettings.of(max_live_sequences=1, idle_timeout_s=5.0))
    s.engine.sequences.clock = lambda: now[0]
    if name == "invalid request":
        bad = chunk(U, 1, 0, 5, start=True)
        bad.inputs["speech_tokens"] = np.array([[7000]], np.int64)
        return s.handle([bad])[0], "fail", None
    if name == "sequence not held":
        return s.handle([chunk(U, 1, 0, 5)])[0], "resume", None
    if name == "unknown voice":
        s.voices = _unknown_voice
        inputs = request_arrays(U.speech_tokens[:5], start=True, voice_id="v-0123456789abcdef")
        return s.handle([Incoming(1, start=True, end=False, inputs=inputs)])[0], "retry", None
    if name == "full":
        s.handle([chunk(U, 1, 0, 10, start=True)])
        return s.handle([chunk(U, 2, 0, 10, start=True)])[0], "busy", 5.1
    if name == "draining":
        s.draining = lambda: True
        return s.handle([chunk(U, 1, 0, 10, start=True)])[0], "resume", None
    s.handle([chunk(U, 1, 0, 10, start=True)])
    if name == "closing":
        s.closing = lambda: True
        outcome = s.handle([chunk(U, 1, 10, 20)])[0]
        assert s.live == 0, "a chunk refused while closing drops its sequence"
        return outcome, "resume", None
    if name.startswith("model call failed"):
        models.fail = True
        if name.endswith("START"):
            return s.handle([chunk(U, 1, 0, 10, start=True)])[0], "retry", None
        if name.endswith("END"):
            return s.handle([chunk(U, 1, 10, 20, end=True)])[0], "resume", None
        return s.handle([chunk(U, 1, 10, 20)])[0], "retry", None
    if name == "bug":
        models.bug = True
        return s.handle([chunk(U, 1, 10, 20)])[0], "fail", None
    assert name == "cancelled"
    return s.handle([chunk(U, 1, 10, 20, is_cancelled=lambda: True)])[0], "fail", None


@pytest.mark.parametrize("name", ["invalid request", "sequence not held", "unknown voice", "full", "draining",
                                  "closing", "model call failed, middle chunk", "model call failed, START",
                                  "model call failed, END", "bug", "cancelled"])
def test_every_error_states_its_disposition_and_sequence(name):
    """Each row of the failure table carries the disposition the table gives it (s3flow_contract.answers),
    naming its sequence, with the busy answer's retry time, and the tag reads back from the message the model
    answers (s3flow.serving.responses.error_response appends it)."""
    from s3flow_contract.answers import answer_of, tagged
    outcome, disposition, retry = _row(name)
    assert outcome.error and outcome.answer is not None, outcome
    assert outcome.answer.disposition.value == disposition and outcome.answer.sequence in (1, 2)
    assert outcome.answer.retry_after_s == retry
    assert (outcome.answer.resend == "prompt") == (name == "unknown voice")
    read = answer_of(f"in ensemble 'token2mel', {tagged(outcome.error, outcome.answer)}")
    assert read == outcome.answer
