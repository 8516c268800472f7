"""``scheduling: deadline`` against a real tritonserver: the cfm_solver with its step loop, beside the
FIFO solver on the same checkpoint (issue 33). Which tests run under which: every other server test runs the
default, ``fifo``; this module runs both and compares them.

Two repositories of the small seeded flow and vocoder, differing only in ``RepositorySettings.scheduling``; each
served model is the same ONNX Runtime graph, so a stream alone must come out the same from both (1e-5), and
streams that share steps within the batched tolerance (2e-4). A third, ``late``, is the deadline solver whose every
START is late on arrival (``first_audio_s`` 0, no player buffer, ``min_steps`` 2): fewer steps end to end.
"""
from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.model.vocoder import VocoderConfig, random_vocoder
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.server.metrics_reader import metric_sum, read_metrics
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance
from s3flow_client.wire import infer_inputs

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("scheduling")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=9))
    hift = random_vocoder(VocoderConfig.small(), seed=3)
    out = {}
    for mode in ("fifo", "deadline"):
        write_repository(root / mode, flow, RepositorySettings(ort_threads=1, scheduling=mode), vocoder=hift)
    late = SolverSettings.of(first_audio_s=0.0, start_buffer_s=0.0, min_steps=2)
    write_repository(root / "late", flow, RepositorySettings(ort_threads=1, scheduling="deadline", solver=late),
                     vocoder=hift)
    with TritonServer(root / "fifo", log_file=root / "fifo.log", background_stop=True) as fifo, \
            TritonServer(root / "deadline", log_file=root / "deadline.log", background_stop=True) as deadline, \
            TritonServer(root / "late", log_file=root / "late.log", background_stop=True) as late:
        out.update(fifo=fifo, deadline=deadline, late=late)
        yield out


def utterance(seconds: float, seed: int, steps: int = 4):
    u = demo_utterance(seconds, seed=seed, noise_seed=seed)
    u.n_timesteps = steps
    return u


@pytest.mark.parametrize("model", ["token2mel", "token2wav"])
def test_a_stream_alone_is_the_same_from_both_solvers(servers, model):
    u = utterance(2.4, 1)
    [fifo] = StreamingClient(servers["fifo"].grpc_url, model).synthesize([u])
    [step] = StreamingClient(servers["deadline"].grpc_url, model).synthesize([u])
    assert fifo.error is None and step.error is None, (fifo.error, step.error)
    assert step.mel.shape == fifo.mel.shape == (80, 2 * len(u.speech_tokens))
    np.testing.assert_allclose(step.mel, fifo.mel, atol=1e-5, rtol=0)
    if model == "token2wav":
        np.testing.assert_allclose(step.audio, fifo.audio, atol=1e-4, rtol=0)


def test_streams_at_once_each_equal_their_stream_alone(servers):
    utts = [utterance(1.2 + 0.6 * k, 10 + k) for k in range(4)]
    alone = [StreamingClient(servers["fifo"].grpc_url).synthesize([u])[0] for u in utts]
    together = StreamingClient(servers["deadline"].grpc_url).synthesize(utts)
    for a, t in zip(alone, together):
        assert t.error is None, t.error
        assert np.abs(t.mel - a.mel).max() < 2e-4


def test_chunks_sent_before_their_answers_are_served_in_order(servers):
    """The stepped solver gets a sequence's next chunk as soon as its execute() returns: a client that sends
    every chunk at once over one stream gets them answered in order, equal to the client that waits."""
    u = utterance(2.0, 21)
    u.chunks = [10, 10, 10, len(u.speech_tokens) - 30]
    [want] = StreamingClient(servers["fifo"].grpc_url).synthesize([u])
    events = queue.Queue()
    client = grpcclient.InferenceServerClient(servers["deadline"].grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    lo = 0
    for k, n in enumerate(u.chunks):
        client.async_stream_infer("token2mel", infer_inputs(u.request(lo, lo + n, k == 0)), sequence_id=2101,
                                  sequence_start=k == 0, sequence_end=k == len(u.chunks) - 1, request_id=str(k))
        lo += n
    got = {}
    for _ in u.chunks:
        result, error = events.get(timeout=60)
        assert error is None, error
        got[int(result.get_response().id)] = (int(result.as_numpy("frame_offset").reshape(-1)[0]),
                                              result.as_numpy("mel")[0])
    client.stop_stream()
    client.close()
    offsets = [got[k][0] for k in range(len(u.chunks))]
    assert offsets == sorted(offsets) and offsets[0] == 0
    mel = np.concatenate([got[k][1] for k in range(len(u.chunks))], axis=1)
    np.testing.assert_allclose(mel, want.mel, atol=1e-5, rtol=0)


def test_the_stepped_solver_answers_a_unary_model_infer_too(servers):
    """Not decoupled (issue 49's spike): a plain unary ModelInfer on token2mel is answered by the step loop, equal
    to the fifo server's answer."""
    u = utterance(1.0, 31)
    inputs = u.request(0, len(u.speech_tokens), True)
    got = {name: servers[name].client().infer("token2mel", infer_inputs(inputs), sequence_id=3101,
                                              sequence_start=True, sequence_end=True).as_numpy("mel")
           for name in ("fifo", "deadline")}
    assert got["deadline"].shape == got["fifo"].shape and got["deadline"].shape[2] == 2 * len(u.speech_tokens)
    np.testing.assert_allclose(got["deadline"], got["fifo"], atol=1e-5, rtol=0)


def raw_stream(url: str, model: str, u, corr_id: int, steps=None) -> list[tuple[np.ndarray, int]]:
    """The utterance's chunks one at a time over one gRPC stream (plain tritonclient), ``steps[k]`` sent as chunk
    k's ``chunk_steps`` (a replay); each answer's (mel, steps)."""
    events = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    out, lo = [], 0
    try:
        for k, n in enumerate(u.chunks):
            arrays = u.request(lo, lo + n, k == 0, chunk_steps=None if steps is None else steps[k])
            client.async_stream_infer(model, infer_inputs(arrays), sequence_id=corr_id, sequence_start=k == 0,
                                      sequence_end=k == len(u.chunks) - 1)
            result, error = events.get(timeout=60)
            assert error is None, error
            out.append((result.as_numpy("mel")[0], int(result.as_numpy("steps").reshape(-1)[0])))
            lo += n
    finally:
        client.stop_stream()
        client.close()
    return out


@pytest.mark.parametrize("model", ["token2mel", "token2wav"])
def test_a_late_start_is_given_fewer_steps_says_so_and_its_replay_elsewhere_makes_the_same_frames(servers, model):
    """On ``late`` every START misses its deadline at its 4 steps and is given min_steps 2: its answer says 2 (through
    token2wav's vocoder too) and the metric counts it; the FIFO server, sent the same chunks with the steps the
    answers said (what a client's replay sends), makes the same frames. Without them it makes other frames."""
    u = utterance(1.6, 41)
    u.chunks = [10, len(u.speech_tokens) - 10]
    def fewer_steps() -> float:
        metrics = read_metrics(f"127.0.0.1:{servers['late'].metrics_port}")
        return metric_sum(metrics, "s3flow_fewer_steps_chunks_total")

    before = fewer_steps()
    got = raw_stream(servers["late"].grpc_url, model, u, 4101)
    steps = [k for _, k in got]
    assert steps[0] == 2 and all(k in (2, 4) for k in steps), steps
    assert fewer_steps() >= before + 1
    again = raw_stream(servers["fifo"].grpc_url, model, u, 4102, steps=steps)
    assert [k for _, k in again] == steps
    np.testing.assert_allclose(np.concatenate([m for m, _ in again], axis=1),
                               np.concatenate([m for m, _ in got], axis=1), atol=1e-5, rtol=0)
    full = raw_stream(servers["fifo"].grpc_url, model, u, 4103)
    assert [k for _, k in full] == [4, 4] and np.abs(full[0][0] - got[0][0]).max() > 1e-3
