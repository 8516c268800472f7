"""Refused STARTs hold nothing (the admission step ahead of the sequence batcher), against a real tritonserver.

A client that is not ours (plain tritonclient) sends 256 STARTs the server refuses, of each kind it can
provoke (a bad token, a voice id the server cannot resolve, while draining, while full), and leaves them
without END; then one well-behaved utterance streams. Its first chunk must arrive within 2 s: a refused START
that had taken one of Triton's 256 sequence slots would keep it for the idle window (idle_timeout_s + Triton's
grace: 35 s on the cpu target, 10 s with the gpu target's reclaim settings) and the utterance would wait in
Triton's backlog. Both reclaim settings are run. Every refusal's answer carries its disposition.
"""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from s3flow_contract.answers import Disposition, answer_of
from s3flow_contract.tensors import request_arrays
from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance
from s3flow_client.wire import infer_inputs

REFUSED = 256
LIVE = 2
#: the cpu target's settings (its Triton grace) and the gpu target's reclaim settings (a 5 s grace)
RECLAIM = {"cpu target": (5.0, None), "gpu reclaim": (5.0, 5.0)}


@pytest.fixture(scope="module", params=sorted(RECLAIM))
def server(request, tmp_path_factory):
    idle, grace = RECLAIM[request.param]
    root = tmp_path_factory.mktemp("refusals")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=5))
    settings = RepositorySettings(solver=SolverSettings.of(max_steps=20, max_live_sequences=LIVE, idle_timeout_s=idle),
                                  ort_threads=1, triton_idle_grace_s=grace)
    write_repository(root / "repo", flow, settings)
    drain_file = root / "draining"
    with TritonServer(root / "repo", log_file=root / "server.log", env={"S3FLOW_DRAIN_FILE": str(drain_file)},
                      background_stop=True) as srv:
        srv.drain_marker = drain_file
        yield srv


def start_tensors(u, **extra):
    return request_arrays(u.speech_tokens[:10], start=True, prompt_tokens=u.prompt_tokens, prompt_mel=u.prompt_mel,
                          speaker_embedding=u.speaker_embedding, n_timesteps=2, **extra)


def send_refused(server, make, first_id: int) -> list:
    """REFUSED STARTs on one raw stream (never ended); the error of each."""
    events = queue.Queue()
    client = server.client()
    # a deadline: the half-close at the end waits for the server to end the stream
    client.start_stream(callback=lambda result, error: events.put((result, error)), stream_timeout=300)
    answers = []
    try:
        for k in range(REFUSED):
            client.async_stream_infer("token2mel", infer_inputs(make()), sequence_id=first_id + k, sequence_start=True)
        answers += [events.get(timeout=60) for _ in range(REFUSED)]
    finally:   # every answer in: half-close (a cancel crossing the last answer leaks it in Triton 2.51)
        client.stop_stream(cancel_requests=len(answers) < REFUSED)
        client.close()
    assert all(result is None and error is not None for result, error in answers), "every START refused"
    return [str(error) for _, error in answers]


def first_chunk_after(server, seed: int) -> float:
    """Seconds until a new utterance's first chunk is answered (by our client: it retries a busy answer)."""
    u = demo_utterance(1.0, seed=seed)
    u.n_timesteps, u.chunks = 2, [10, 15]
    began = {}
    t0 = time.monotonic()
    [r] = StreamingClient(server.grpc_url, timeout_s=60).synthesize(
        [u], progress=lambda _: began.setdefault("t", time.monotonic()))
    assert r.error is None and r.mel.shape == (80, 50)
    return began["t"] - t0


def bad_token():
    u = demo_utterance(1.0, seed=1)
    t = start_tensors(u)
    t["speech_tokens"] = np.array([[1, 9999]], np.int64)
    return t


def unknown_voice():
    u = demo_utterance(1.0, seed=2)
    return request_arrays(u.speech_tokens[:10], start=True, voice_id="v-0123456789abcdef")


@pytest.mark.server
@pytest.mark.parametrize("kind", ["bad token", "unknown voice", "draining", "full"])
def test_refused_starts_left_open_do_not_delay_the_next_utterance(server, kind):
    holders = []
    if kind == "draining":
        server.drain_marker.write_text("draining\n")
    if kind == "full":   # two valid sequences fill the solver; they are ENDed once the refusals are sent
        u = demo_utterance(1.0, seed=3)
        for cid in (90_001, 90_002):
            server.client().infer("token2mel", infer_inputs(start_tensors(u)), sequence_id=cid, sequence_start=True)
            holders.append(cid)
    make = {"bad token": bad_token, "unknown voice": unknown_voice, "draining": lambda: start_tensors(
        demo_utterance(1.0, seed=4)), "full": lambda: start_tensors(demo_utterance(1.0, seed=4))}[kind]
    errors = send_refused(server, make, first_id=1_000_000 * (1 + ["bad token", "unknown voice", "draining",
                                                                   "full"].index(kind)))
    want = {"bad token": Disposition.FAIL, "unknown voice": Disposition.FAIL, "draining": Disposition.RESUME,
            "full": Disposition.BUSY}[kind]
    assert {answer_of(e).disposition for e in errors} == {want}, errors[:2]
    assert all("admission" in e for e in errors), errors[:2]   # refused before the solver's batcher
    server.drain_marker.unlink(missing_ok=True)
    for cid in holders:
        server.client().infer("token2mel", infer_inputs(request_arrays(np.zeros(0, np.int64))), sequence_id=cid,
                              sequence_end=True)
    seconds = first_chunk_after(server, seed=10)
    print(f"\n{kind}: {REFUSED} refused STARTs left open; the next utterance's first chunk after {seconds:.2f} s")
    assert seconds < 2.0
