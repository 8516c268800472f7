"""Streams of any length against a real tritonserver: a 3-minute utterance (9,000 frames, three times the old
60 s cap) through token2wav in bounded-context mode, offsets exact, 2 frames per token, 480 samples per frame,
the audio continuous at every seam (each response's samples start where the last ones ended). The 10-minute
run with its latency, memory and resume figures is ``python -m s3flow_tools.measure.long_stream``
(results/long_stream.md)."""
from __future__ import annotations

import numpy as np
import pytest

from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.model.vocoder import VocoderConfig, random_vocoder
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance

MINUTES = 3.0


@pytest.mark.server
def test_a_three_minute_utterance_streams_through_token2wav_exactly(tmp_path):
    flow = load_flow(write_random_checkpoint(tmp_path / "ckpt.safetensors", FlowConfig.small(), seed=6))
    settings = RepositorySettings(solver=SolverSettings.of(max_steps=4, max_utterance_frames=3000), ort_threads=1)
    write_repository(tmp_path / "repo", flow, settings, vocoder=random_vocoder(VocoderConfig.small(), seed=6))
    u = demo_utterance(60 * MINUTES, seed=7)
    n = len(u.speech_tokens)
    u.n_timesteps, u.chunks = 1, [10, 40] + [100] * ((n - 50) // 100) + ([(n - 50) % 100] if (n - 50) % 100 else [])
    with TritonServer(tmp_path / "repo", log_file=tmp_path / "server.log", background_stop=True) as server:
        [r] = StreamingClient(server.grpc_url, model="token2wav").synthesize([u])
    assert r.error is None and r.mel.shape == (80, 2 * n) and 2 * n >= 3000 * MINUTES
    assert r.audio.shape == (480 * 2 * n,) and np.isfinite(r.audio).all()
    assert sum(r.chunk_frames) == 2 * n and sum(r.chunk_samples) == 480 * 2 * n
    assert len(r.chunk_frames) == len(u.chunks) and not r.retries and not r.resumes
