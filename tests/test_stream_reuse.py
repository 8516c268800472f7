"""A stream that keeps what it solved (``s3flow.engine.reuse``): the frames it no longer solves, and what it
answers (every frame, in order; the first chunk exactly as without reuse; later ones near it)."""
import numpy as np
import pytest
import torch

from helpers import make_engine, small_flow, stream_in_process, torch_encoder
from s3flow.engine.planning import planned_calls
from s3flow.engine.settings import SolverSettings
from s3flow.engine.streaming import StreamingEngine
from s3flow.model.flow import TorchEstimator
from s3flow.model.prefix_cache import CacheShape
from s3flow_client import chunk_schedule
from s3flow_client.demo import demo_utterance

SIZES = [10, 20, 40, 5]


class Counting(TorchEstimator):
    """The torch estimator, counting each call's (rows, frames)."""

    def __init__(self, module):
        super().__init__(module)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, inputs):
        self.calls.append((inputs.x.shape[0], inputs.x.shape[2]))
        return super().__call__(inputs)


def _keep(keep_solved: int, **flat) -> SolverSettings:
    return SolverSettings.of(keep_solved=keep_solved, **flat)


def _stream(flow, u, keep_solved, sizes=SIZES):
    results = stream_in_process(make_engine(flow, _keep(keep_solved)), [u], [sizes])[0]
    return results, np.concatenate([r.mel for r in results], axis=1)


@pytest.mark.parametrize("keep_solved", [1, 2])
def test_every_frame_is_answered_in_order_the_first_chunk_exactly_as_without_reuse(keep_solved):
    flow = small_flow()
    u = demo_utterance(3.0, seed=2, prompt_seconds=2.0)
    before, mel_before = _stream(flow, u, 0)
    after, mel_after = _stream(flow, u, keep_solved)
    assert [r.frame_offset for r in after] == [r.frame_offset for r in before]
    assert mel_after.shape == mel_before.shape == (80, 2 * sum(SIZES))
    np.testing.assert_array_equal(after[0].mel, before[0].mel)   # the first chunk only keeps its cache


@pytest.mark.parametrize("keep_solved", [1, 2])
def test_later_chunks_stay_near_the_unchanged_stream_far_inside_the_seed_spread(keep_solved):
    """The kept frames no longer attend to the new ones: an approximation. On random weights (no training to
    make it small) it moves the mel well inside the distance between two seeds."""
    flow = small_flow()
    u = demo_utterance(3.0, seed=2, prompt_seconds=2.0)
    other_seed = demo_utterance(3.0, seed=2, noise_seed=99, prompt_seconds=2.0)
    _, base = _stream(flow, u, 0)
    _, kept = _stream(flow, u, keep_solved)
    _, spread = _stream(flow, other_seed, 0)
    moved, seeds = np.abs(kept - base).mean(), np.abs(spread - base).mean()
    assert 0 < moved < 0.5 * seeds


@pytest.mark.parametrize("keep_solved, total", [(0, 618), (1, 468), (2, 300)])
def test_the_frames_solved_are_the_plans(keep_solved, total):
    """5 s with a 10 s prompt on the default settings: each Euler step of the whole stream solves 618 frames
    today, 468 with the prompt kept, 300 (the one request's: 50 prompt + 250) with every frame once; the engine
    over the torch model calls exactly what the plan counts."""
    flow = small_flow()
    u = demo_utterance(5.0, seed=4, prompt_seconds=10.0)
    sizes = chunk_schedule(len(u.speech_tokens))
    planned = planned_calls(80, len(u.prompt_tokens), sizes, 100, 10, prompt_frames=50, keep_solved=keep_solved)
    est = Counting(flow.estimator)
    engine = StreamingEngine(torch_encoder(flow), est, n_feats=80, meanflow=False,
                             solving=_keep(keep_solved).solving)
    stream_in_process(engine, [u], [sizes])
    assert est.calls == planned
    assert sum(f for _, f in planned) == 10 * total


def test_a_chunk_at_other_steps_solves_the_prompt_inline_and_keeps_its_own_cache():
    """A cache is of one Euler grid: a chunk at fewer steps (a replay naming its steps, or the scheduler's) reads
    none; every frame still comes, and the next chunk at the stream's steps keeps a cache again."""
    flow = small_flow()
    u = demo_utterance(3.0, seed=5, prompt_seconds=2.0)
    est = Counting(flow.estimator)
    engine = StreamingEngine(torch_encoder(flow), est, n_feats=80, meanflow=False, solving=_keep(2).solving)
    from s3flow.protocol import RequestRules, parse_request
    done, lo = 0, 0
    for k, size in enumerate(SIZES):
        inputs = u.request(lo, lo + size, k == 0)
        if k == 2:
            inputs["chunk_steps"] = np.array([[4]], np.int32)
        req = parse_request(inputs, start=k == 0, end=k == len(SIZES) - 1, rules=RequestRules(), n_feats=80)
        before = len(est.calls)
        [res] = engine.run([engine.admit(1, req)])
        assert res.frame_offset == done
        done += res.mel.shape[1]
        lo += size
        widths = {f for _, f in est.calls[before:]}
        if k == 2:   # at 4 steps: the prompt (50 frames) and context solved inline
            assert len(est.calls) - before == 4 and min(widths) >= 50
    assert done == 2 * sum(SIZES)


def test_a_long_streams_cache_stays_bounded():
    """The prompt and the last C emitted frames: a 30 s stream keeps what a 5 s one does."""
    flow = small_flow()
    engine = make_engine(flow, _keep(2, context_frames=20))
    u = demo_utterance(12.0, seed=6, prompt_seconds=2.0)
    sizes = chunk_schedule(len(u.speech_tokens), 10, 2.0, 40)
    from s3flow.protocol import RequestRules, parse_request
    lo, held = 0, []
    for k, size in enumerate(sizes[:-1]):
        req = parse_request(u.request(lo, lo + size, k == 0), start=k == 0, end=False, rules=RequestRules(),
                            n_feats=80)
        engine.run([engine.admit(3, req)])
        lo += size
        cache = engine.sequences.peek(3).cache
        held.append(cache.caches[0][0].frames)
        assert cache.prompt + cache.generated == held[-1] <= 50 + 20
    assert held[-1] == held[-2] == 70
    shape = CacheShape.of(flow.estimator.config)   # what docs/streaming.md's memory table counts
    per_step_half = 4 * (shape.layers * 2 * shape.heads * shape.head_dim * 70 + shape.convs * shape.width * 2)
    assert cache.nbytes() == 10 * 2 * per_step_half


def test_keeping_needs_bounded_context_and_an_estimator_that_takes_a_cache():
    flow = small_flow()
    with pytest.raises(ValueError, match="bounded context"):
        _keep(1, context_frames=-1)
    with pytest.raises(ValueError, match="bounded context"):
        _keep(2, slide_prompt=1)
    with pytest.raises(ValueError, match="carries_prefix"):
        StreamingEngine(torch_encoder(flow), lambda i: torch.zeros_like(i.x), n_feats=80, meanflow=False,
                        solving=_keep(2).solving)
    with pytest.raises(ValueError, match="must be 0, 1 or 2"):
        _keep(3)


def test_a_repository_keeps_only_where_its_estimator_can_take_a_cache():
    from s3flow.repository.settings import RepositorySettings

    solver = _keep(2)
    with pytest.raises(ValueError, match="TensorRT plans have no cache"):
        RepositorySettings(solver=solver, target="gpu").check()
    RepositorySettings(solver=solver, target="gpu", gpu_backend="torch").check()
    RepositorySettings(solver=solver).check()
