"""Keeping what streams solved, served: the estimator's cached graph behind a real tritonserver (``keep_solved``).

The solver sends each step's prefix cache to ``estimator`` over BLS and keeps what it returns (``s3flow.engine.
reuse``); the streams must equal the in-process engine's with the same setting, chunk for chunk, alone and
batched with others at different points of their streams. A registered voice holds its prompt's cache
(``voice_cache_mb``, ``s3flow.engine.voice_prompts``): its second stream calls the estimator for no prompt pass.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from helpers import make_engine, stream_in_process
from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.flow import FlowConfig
from s3flow.model.prefix_cache import CacheShape
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.repository.generator import write_repository
from s3flow.repository.model_config import read_config
from s3flow.repository.settings import Batching, RepositorySettings, VoiceSettings
from s3flow.server.metrics_reader import metric_sum, read_metrics
from s3flow.server.triton_server import TritonServer
from s3flow.serving.local_stream import stream_in_process as stream_session
from s3flow.serving.session import SolverSession
from s3flow_client import StreamingClient, chunk_schedule
from s3flow_client.demo import demo_utterance
from s3flow_client.voices import register_prompt

pytestmark = pytest.mark.server
SOLVER = SolverSettings.of(keep_solved=2, context_frames=30, max_live_sequences=16, voice_cache_mb=16)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse")
    ckpt = write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=9)
    flow = load_flow(ckpt)
    settings = RepositorySettings(solver=SOLVER, batching=Batching(max_queue_delay_us=20_000), ort_threads=1,
                                  voices=VoiceSettings(max_voices=8))
    write_repository(root / "repo", flow, settings, voice_checkpoint=ckpt)
    with TritonServer(root / "repo", log_file=root / "server.log", background_stop=True) as server:
        yield server, flow, root / "repo"


def test_the_repository_serves_the_cached_graph_and_tells_the_solver_its_shape(served):
    _, flow, repo = served
    estimator = read_config(repo / "estimator")
    assert [t.name for t in estimator.input][-1] == "past"
    assert [t.name for t in estimator.output] == ["velocity", "kept"]
    solver = read_config(repo / "cfm_solver")
    assert solver.parameters["estimator_cache"].string_value == CacheShape.of(flow.estimator.config).parameter()
    assert solver.parameters["keep_solved"].string_value == "2"


def test_a_served_stream_equals_the_in_process_one_with_the_same_keeping(served):
    server, flow, _ = served
    u = demo_utterance(3.0, seed=11, noise_seed=3, prompt_seconds=2.0)
    u.chunks = chunk_schedule(len(u.speech_tokens), 8, 2.0, 30)
    [got] = StreamingClient(server.grpc_url).synthesize([u])
    [local] = stream_in_process(make_engine(flow, SOLVER), [u], [u.chunks], rules=SOLVER.rules)
    assert got.mel.shape == (80, 2 * len(u.speech_tokens))
    np.testing.assert_allclose(got.mel, np.concatenate([r.mel for r in local], 1), atol=5e-4, rtol=0)
    [plain] = stream_in_process(make_engine(flow, SolverSettings.of(context_frames=30)), [u], [u.chunks])
    assert np.abs(got.mel - np.concatenate([r.mel for r in plain], 1)).mean() > 1e-3   # it did keep


def test_streams_at_once_each_at_its_own_point_equal_each_alone(served):
    """Chunks of streams with different prompts, at their first chunk (keeping) or later (reading), batched into
    the same estimator calls: each stream equals itself alone."""
    server, _, _ = served
    utts = []
    for i in range(4):
        u = demo_utterance(1.6 + 0.5 * i, seed=20 + i, noise_seed=i, prompt_seconds=0.4 + 0.4 * i)
        u.chunks = chunk_schedule(len(u.speech_tokens), 6 + 2 * i, 2.0, 24)
        utts.append(u)
    client = StreamingClient(server.grpc_url)
    together = client.synthesize(utts)
    for u, got in zip(utts, together):
        [alone] = client.synthesize([u])
        assert got.mel.shape[1] == 2 * len(u.speech_tokens)
        np.testing.assert_allclose(got.mel, alone.mel, atol=5e-4, rtol=0)


def _estimator_calls(server) -> int:
    return int(server.client().get_inference_statistics("estimator").model_stats[0].execution_count)


def test_a_voices_second_stream_makes_no_prompt_pass_and_streams_as_in_process(served):
    """Started by voice id: the voice's first stream calls the estimator for its prompt pass (the steps of the
    prompt alone) and its chunks, the second (another seed) for its chunks only; each equals the in-process engine
    over the same voice, and differs from the stream that sends its prompt itself (whose first chunk solves it)."""
    server, flow, _ = served
    u = demo_utterance(2.0, seed=13, noise_seed=1, prompt_seconds=1.2)
    voice = register_prompt(server.grpc_url, u.prompt_tokens, u.prompt_mel, u.speaker_embedding)
    steps, sizes = 4, chunk_schedule(len(u.speech_tokens), 8, 2.0, 30)
    client = StreamingClient(server.grpc_url)
    calls, got = [], []
    for seed in (1, 2):
        v = voice.utterance(u.speech_tokens, seed=seed, n_timesteps=steps)
        v.chunks = sizes
        before = _estimator_calls(server)
        [r] = client.synthesize([v])
        calls.append(_estimator_calls(server) - before)
        assert not r.retries and r.mel.shape == (80, 2 * len(u.speech_tokens))
        got.append(r.mel)
    assert calls == [steps * (len(sizes) + 1), steps * len(sizes)]
    # the instance says what it holds: the voice's 50 capped prompt frames' keys, values and convolution tails, both
    # guidance rows, at each step
    shape = CacheShape.of(flow.estimator.config)
    one_row = 4 * (2 * shape.layers * shape.heads * shape.head_dim * 50 + shape.convs * shape.width * shape.tail)
    t0, held = time.monotonic(), 0.0
    while held != steps * 2 * one_row and time.monotonic() - t0 < 5:   # (published at most every second)
        time.sleep(0.2)
        held = metric_sum(read_metrics(f"127.0.0.1:{server.metrics_port}"), "s3flow_voice_prompt_cache_bytes")
    assert held == steps * 2 * one_row
    held = {"prompt_tokens": u.prompt_tokens[None], "prompt_mel": u.prompt_mel[None],
            "speaker_embedding": u.speaker_embedding[None]}
    session = SolverSession(make_engine(flow, SOLVER), SOLVER.rules, voices=lambda voice_id, tenant: held)
    local = stream_session(session, u.speech_tokens, sizes, voice_id=voice.voice_id, seed=2, n_timesteps=steps)
    np.testing.assert_allclose(got[1], local.mel, atol=5e-4, rtol=0)
    by_prompt = voice.utterance(u.speech_tokens, seed=2, n_timesteps=steps)
    by_prompt.voice_id, by_prompt.chunks = None, sizes
    [plain] = client.synthesize([by_prompt])
    assert np.abs(plain.mel - got[1]).mean() > 1e-3
