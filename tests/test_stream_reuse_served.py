"""Keeping what streams solved, served: the estimator's cached graph behind a real tritonserver (``keep_solved``).

The solver sends each step's prefix cache to ``estimator`` over BLS and keeps what it returns (``s3flow.engine.
reuse``); the streams must equal the in-process engine's with the same setting, chunk for chunk, alone and
batched with others at different points of their streams.
"""
from __future__ import annotations

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
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient, chunk_schedule
from s3flow_client.demo import demo_utterance

pytestmark = pytest.mark.server
SOLVER = SolverSettings.of(keep_solved=2, context_frames=30, max_live_sequences=16)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=9))
    settings = RepositorySettings(solver=SOLVER, batching=Batching(max_queue_delay_us=20_000), ort_threads=1)
    write_repository(root / "repo", flow, settings)
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
