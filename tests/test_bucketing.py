"""Length bucketing of the streaming engine: a batch of chunks with very different prefix lengths is split
into several padded batches; each row's output is the same as without bucketing (small config; seconds)."""
import numpy as np
import pytest
import torch

from helpers import small_flow, stream_in_process, torch_encoder
from s3flow.serving.config_params import Params
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow.repository.configs import solver_config
from s3flow.engine.settings import ChunkSolving
from s3flow.engine.streaming import StreamingEngine
from s3flow_client.demo import demo_utterance


def engine(flow, ratio: float, calls: list):
    def estimator(inputs):
        calls.append((inputs.x.shape[0], inputs.x.shape[2]))
        with torch.inference_mode():
            return flow.estimator(**inputs.named())
    # the whole prompt conditions every chunk, so the prompts' lengths spread the prefixes (the figures below)
    return StreamingEngine(torch_encoder(flow), estimator, n_feats=80, meanflow=False, bucket_ratio=ratio,
                           solving=ChunkSolving(prompt_frames=-1))


def test_buckets_split_by_length_and_give_the_same_frames():
    flow = small_flow()
    # prompts of 0.4 s and 2 s and first chunks of 4 to 40 tokens: prefixes from 34 to 154 frames
    utts = [demo_utterance(1.6, seed=40 + i, noise_seed=i, prompt_seconds=p) for i, p in enumerate([0.4, 0.4, 2.0, 2.0])]
    for u in utts:
        u.n_timesteps = 2
    sizes = [[4, 36], [6, 34], [30, 10], [40]]
    flat, bucketed = [], []
    ref = stream_in_process(engine(flow, 0.0, flat), utts, sizes)
    got = stream_in_process(engine(flow, 1.5, bucketed), utts, sizes)
    # round 0 prefixes: 22, 26, 154, 180 frames; round 1: 100, 100, 180. Without bucketing one padded
    # batch per round and step (guided: 2 rows per utterance); with ratio 1.5, two batches per round
    assert flat == [(8, 180)] * 2 + [(6, 180)] * 2
    assert bucketed == [(4, 26)] * 2 + [(4, 180)] * 2 + [(4, 100)] * 2 + [(2, 180)] * 2, bucketed
    for r_rows, g_rows in zip(ref, got):
        for r, g in zip(r_rows, g_rows):
            assert r.frame_offset == g.frame_offset
            np.testing.assert_allclose(g.mel, r.mel, atol=2e-4, rtol=0)


def test_bucket_ratio_is_a_checked_repository_setting():
    config = solver_config(80, False, RepositorySettings(batching=Batching(length_bucket_ratio=2.0)))
    assert Params(config).float("length_bucket_ratio") == 2.0
    with pytest.raises(ValueError, match="length_bucket_ratio"):
        Batching(length_bucket_ratio=0.5).check()
    with pytest.raises(ValueError, match="bucket_ratio"):
        StreamingEngine(None, None, n_feats=80, meanflow=False, bucket_ratio=0.5)


@pytest.mark.parametrize("ratio", [0.0, 1.0, 1.5, 0.5, 0.99, -1.0])
def test_the_repository_and_the_engine_hold_the_bucket_ratio_to_one_rule(ratio):
    """What the repository setting refuses, the engine refuses too, with the same words (each its own name)."""
    def refusal(make):
        try:
            make()
        except ValueError as exc:
            return str(exc)
        return None

    setting = refusal(lambda: Batching(length_bucket_ratio=ratio).check())
    engine_arg = refusal(lambda: StreamingEngine(None, None, n_feats=80, meanflow=False, bucket_ratio=ratio))
    assert (setting is None) == (engine_arg is None) == (not ratio or ratio >= 1)
    if setting is not None:
        assert setting == "length_" + engine_arg == f"length_bucket_ratio must be 0 (off) or >= 1, got {ratio}"
