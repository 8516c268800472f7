"""The streaming engine in process: chunks vs offline synthesis, batching, state lifecycle."""
import numpy as np
import pytest
import torch

from helpers import make_engine, offline, small_flow, stream_in_process
from s3flow.model.flow import synthesize
from s3flow.protocol import Limits, RequestError, parse_request
from s3flow.engine.streaming import SequenceStore
from s3flow_client import chunk_schedule
from s3flow_client.demo import demo_utterance

#: the prefix re-run mode, whatever the server's default
PREFIX = Limits(context_frames=-1)


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
    limits = Limits(context_frames=context)
    utts = [demo_utterance(s, seed=i, noise_seed=10 + i, prompt_seconds=p)
            for i, (s, p) in enumerate([(1.2, 0.6), (2.0, 1.0), (0.8, 0.4), (1.6, 0.8)])]
    sizes = [chunk_schedule(len(u.speech_tokens), 5 + i, 2.0, 30) for i, u in enumerate(utts)]
    batched = stream_in_process(make_engine(flow, limits), utts, sizes)
    for u, s, got in zip(utts, sizes, batched):
        [alone] = stream_in_process(make_engine(flow, limits), [u], [s])
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
    [res] = stream_in_process(make_engine(flow, Limits(holdback_frames=8)), [u], [[10, 10, 20]])
    assert [r.frame_offset for r in res] == [0, 14 - 8, 34 - 8]
    assert sum(r.mel.shape[1] for r in res) == 80


def test_unknown_sequence_and_state_lifecycle():
    flow = small_flow()
    engine = make_engine(flow, Limits(max_live_sequences=2))
    u = demo_utterance(1.0, seed=1)
    req = parse_request({"speech_tokens": u.speech_tokens[None, :5]}, start=False, end=False, limits=engine.limits)
    with pytest.raises(RequestError, match="sequence 42 is not active"):
        engine.admit(42, req)
    stream_in_process(engine, [u], [[10, 15]])
    assert len(engine.store) == 0, "END drops the sequence's state"
    from helpers import request_inputs
    for cid in (1, 2):
        engine.admit(cid, parse_request(request_inputs(u, 0, 5, True), start=True, end=False, limits=engine.limits))
    with pytest.raises(RequestError, match="too many live sequences"):
        engine.admit(3, parse_request(request_inputs(u, 0, 5, True), start=True, end=False, limits=engine.limits))


def test_utterance_frame_limit_ends_the_sequence():
    flow = small_flow()
    engine = make_engine(flow, Limits(max_utterance_frames=40))
    u = demo_utterance(2.0, seed=1)
    from helpers import request_inputs
    engine.run([engine.admit(1, parse_request(request_inputs(u, 0, 15, True), start=True, end=False,
                                              limits=engine.limits))])
    with pytest.raises(RequestError, match="42 frames, above max_utterance_frames 40"):
        engine.admit(1, parse_request(request_inputs(u, 15, 21, False), start=False, end=False, limits=engine.limits))
    assert 1 not in engine.store


def test_idle_sequences_are_evicted():
    now = [0.0]
    store = SequenceStore(Limits(idle_timeout_s=5.0), clock=lambda: now[0])
    store.create(1, object.__new__(__import__("s3flow.engine.streaming", fromlist=["SequenceState"]).SequenceState))
    store.create(2, object.__new__(__import__("s3flow.engine.streaming", fromlist=["SequenceState"]).SequenceState))
    now[0] = 4.0
    store.get(2)
    now[0] = 6.0
    assert store.evict_idle() == [1]
    assert 1 not in store and 2 in store
    now[0] = 20.0
    assert store.evict_idle() == [2] and len(store) == 0


# ------------------------------------------------------------------------------- bounded context


def _offline_window(flow, u, prompt_frames_ctx, c0, e, n, final):
    """Offline synthesis of a bounded-context chunk as an independent call: the prompt extended by the
    context (tokens [c0/2, e/2) and their emitted mel), speech tokens [e/2, n), the same starting point."""
    from s3flow.model.solver import FrameNoise
    ctx_tokens = u.speech_tokens[c0 // 2:e // 2]
    prompt_tokens = np.concatenate([u.prompt_tokens, ctx_tokens])
    prompt_feat = np.concatenate([u.prompt_mel, prompt_frames_ctx.T], axis=0)  # frames-major
    noise = FrameNoise(u.seed, 80)
    g = 2 * n if final else 2 * n - 6
    z = np.concatenate([noise.prompt(u.prompt_mel.shape[0]), noise.frames(c0, g)], axis=1)
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
    [results] = stream_in_process(make_engine(flow, Limits(context_frames=context)), [u], [sizes])
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


def test_bounded_context_cost_per_chunk_does_not_grow_with_the_utterance():
    flow = small_flow()
    u = demo_utterance(8.0, seed=2)
    sizes = [10] + [19] * 10
    u.n_timesteps = 1
    costs = {}
    for context in (-1, 24):
        engine = make_engine(flow, Limits(context_frames=context))
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

    def send(self, k, cid=7):
        from helpers import request_inputs
        lo = sum(self.sizes[:k])
        end = k == len(self.sizes) - 1
        req = parse_request(request_inputs(self.u, lo, lo + self.sizes[k], k == 0), start=k == 0, end=end,
                            limits=self.engine.limits)
        return self.engine.run([self.engine.admit(cid, req)])[0]


class _FailingEstimator:
    def __init__(self, inner):
        self.inner, self.fail = inner, False

    def __call__(self, *args, **kwargs):
        if self.fail:
            raise RuntimeError("estimator went away")
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("context", [-1, 12])
def test_a_failed_chunk_leaves_the_state_as_before_and_a_retry_continues_exactly(context):
    from helpers import torch_encoder
    from s3flow.model.flow import TorchEstimator
    from s3flow.engine.streaming import StreamingEngine
    flow = small_flow()
    u = demo_utterance(1.6, seed=8, noise_seed=2)
    u.n_timesteps = 3
    sizes = [10, 12, 18]
    limits = Limits(context_frames=context, holdback_frames=3)
    [undisturbed] = stream_in_process(make_engine(flow, limits), [u], [sizes])
    est = _FailingEstimator(TorchEstimator(flow.estimator))
    engine = StreamingEngine(torch_encoder(flow), est, n_feats=80, meanflow=False, limits=limits)
    d = _Driver(engine, u, sizes)
    got = [d.send(0)]
    state = engine.store.get(7)
    before = (state.tokens.copy(), state.noised_mels.values.copy(), state.noised_mels.start, state.emitted,
              None if state.mel_tail is None else state.mel_tail.copy())
    est.fail = True
    with pytest.raises(RuntimeError, match="went away"):
        d.send(1)
    after = engine.store.get(7)
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
    assert 8 not in engine.store
