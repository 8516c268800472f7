"""Admission by capacity against a real tritonserver: the solver calibrates at load and exports its capacity and
utilization; a START the server cannot carry is refused at admission with busy and a retry_after, to a plain
tritonclient and to our client alike.

The repository's target is tiny (1e-3), so that after the calibration every START through either ensemble is over
it while the server holds a stream: one started directly at ``cfm_solver`` (past admission), which the utilization
counts. An idle server takes a stream whatever its estimate.
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
from s3flow.model.vocoder import VocoderConfig, random_vocoder
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.server.metrics_reader import metric_sum, read_metrics
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance
from s3flow_client.stream import StreamError
from s3flow_client.wire import infer_inputs

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("capacity")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=8))
    settings = RepositorySettings(solver=SolverSettings.of(max_steps=20, utilization_target=1e-3, idle_timeout_s=120.0),
                                  ort_threads=1)
    write_repository(root / "repo", flow, settings, vocoder=random_vocoder(VocoderConfig.small(), seed=3))
    with TritonServer(root / "repo", log_file=root / "server.log", background_stop=True) as srv:
        t0 = time.monotonic()
        while gauge(srv, "s3flow_capacity_audio_seconds_per_second") <= 0:   # the calibration at load
            assert time.monotonic() - t0 < 60, "the solver never published a capacity: " + srv.log_tail()
            time.sleep(0.25)
        held = srv.client()
        held.infer("cfm_solver", infer_inputs(start_tensors(30)), sequence_id=HELD, sequence_start=True)
        held.close()
        yield srv


HELD = 7_000

def gauge(server, name: str) -> float:
    return metric_sum(read_metrics(f"127.0.0.1:{server.metrics_port}"), name)


def start_tensors(seed: int):
    u = demo_utterance(1.0, seed=seed)
    return request_arrays(u.speech_tokens[:10], start=True, prompt_tokens=u.prompt_tokens, prompt_mel=u.prompt_mel,
                          speaker_embedding=u.speaker_embedding, n_timesteps=2)


def test_the_server_exports_its_capacity_and_the_held_streams_utilization(server):
    assert gauge(server, "s3flow_capacity_audio_seconds_per_second") > 0
    t0 = time.monotonic()
    while gauge(server, "s3flow_utilization") <= 0:
        assert time.monotonic() - t0 < 10, "a held sequence shows no utilization"
        time.sleep(0.2)


def test_a_new_servers_vocoder_is_priced_before_its_first_stream(server):
    """The vocoder calibrates once the solver has (nothing saved here, no token2wav stream yet): token2wav's
    capacity holds the vocoder's time from then on (issue 48: a new server priced its first token2wav burst by the
    solver alone, and 4 of the 5 streams it admitted stalled)."""
    from s3flow.serving.load import LoadBoard

    board, t0 = LoadBoard(LoadBoard.default_folder(server.pid)), time.monotonic()
    while not board.read().vocoder_capacity and time.monotonic() - t0 < 30:   # (moments after the solver's)
        time.sleep(0.1)
    load = board.read()
    vocoders = [r for r in load.reports if r.kind == "vocoder"]
    assert vocoders and all(not r.streams and not r.waiting for r in vocoders), "no stream went through a vocoder"
    assert load.vocoder_capacity > 0
    assert 0 < load.wav_capacity < load.capacity, "token2wav's capacity holds the vocoder's device time"
    assert "vocoder: calibration" in server.log_file.read_text()


def test_a_start_over_capacity_is_refused_busy_at_admission_to_a_plain_client(server):
    """Each ensemble's START is priced as what it makes (the output its admission step asks for): the refusal
    names token2mel's or token2wav's stream."""
    events = queue.Queue()
    client = server.client()
    # a deadline: the half-close at the end waits for the server to end the stream
    client.start_stream(callback=lambda result, error: events.put((result, error)), stream_timeout=300)
    models = ["token2mel", "token2wav"] * 4
    answers = []
    try:
        for k, model in enumerate(models):   # never ended: a refusal holds nothing
            client.async_stream_infer(model, infer_inputs(start_tensors(k)), sequence_id=5_000 + k,
                                      sequence_start=True, request_id=model)
        answers += [events.get(timeout=30) for _ in range(8)]
    finally:   # every answer in: half-close (a cancel crossing the last answer leaks it in Triton 2.51)
        client.stop_stream(cancel_requests=len(answers) < 8)
        client.close()
    for result, error in answers:
        assert result is None and error is not None
        answer = answer_of(str(error))
        assert answer.disposition is Disposition.BUSY and 0.2 <= answer.retry_after_s <= 5.0, str(error)
        assert "admission" in str(error) and "at capacity: the solver's utilization" in str(error)
    said = sorted(m for _, e in answers for m in ("token2mel stream", "token2wav stream") if m in str(e))
    assert said == ["token2mel stream"] * 4 + ["token2wav stream"] * 4, [str(e) for _, e in answers]
    deadline = time.monotonic() + 5.0   # admission publishes a refusal's metrics off its request path (ms later)
    while True:
        metrics = read_metrics(f"127.0.0.1:{server.metrics_port}")
        counted = (metric_sum(metrics, "s3flow_admission_refusals_total", reason="capacity"),
                   metric_sum(metrics, "s3flow_admission_retry_after_seconds_count"))
        if min(counted) >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert min(counted) >= 8, f"refusals counted, retry_after observed: {counted} of at least 8"


def test_our_client_retries_after_the_retry_after_and_reports_the_busy_answers(server):
    u = demo_utterance(1.0, seed=20)
    u.n_timesteps = 2
    t0 = time.monotonic()
    with pytest.raises(StreamError) as caught:
        StreamingClient(server.grpc_url, timeout_s=60, max_retries=1, max_resumes=0).synthesize([u])
    took = time.monotonic() - t0
    [r] = caught.value.results
    busy = [answer_of(m) for m in r.retries]
    assert len(busy) == 1 and busy[0].disposition is Disposition.BUSY
    assert took >= busy[0].retry_after_s, "the retry waited for the retry_after"
    assert "disposition=busy" in r.error
    assert 0 < r.error_after_s < busy[0].retry_after_s, "the last refusal's own answer time, from its START's send"


def test_once_the_held_stream_ends_the_idle_server_takes_a_stream_and_its_utilization_is_back_to_0(server):
    client = server.client()
    try:
        client.infer("cfm_solver", infer_inputs(request_arrays(np.zeros(0, np.int64))), sequence_id=HELD,
                     sequence_end=True)
    finally:
        client.close()
    t0 = time.monotonic()
    while gauge(server, "s3flow_utilization") > 0:
        assert time.monotonic() - t0 < 10, "an ended sequence still counts"
        time.sleep(0.2)
    u = demo_utterance(1.0, seed=21)
    u.n_timesteps = 2
    [r] = StreamingClient(server.grpc_url, timeout_s=60, max_retries=0, max_resumes=0).synthesize([u])
    assert r.error is None and r.mel.shape == (80, 50) and r.retries == []


def test_a_stream_quiet_between_sentences_keeps_its_place_and_is_answered_when_it_comes_back(server):
    """Issue 48, what a quiet stream is owed: an admitted client that pauses between sentences (3 s, under the idle
    timeout) is still priced as a live stream, so the place it was admitted to is not given away (a START in the
    pause is refused busy), and its next chunks are answered when it comes back, every frame in order."""
    u = demo_utterance(2.0, seed=22)
    events = queue.Queue()
    client = server.client()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        first = request_arrays(u.speech_tokens[:20], start=True, prompt_tokens=u.prompt_tokens,
                               prompt_mel=u.prompt_mel, speaker_embedding=u.speaker_embedding, n_timesteps=2)
        client.async_stream_infer("token2mel", infer_inputs(first), sequence_id=6_100, sequence_start=True)
        result, error = events.get(timeout=60)
        assert error is None, str(error)
        offsets = [int(result.as_numpy("frame_offset")[0, 0])]
        frames = [result.as_numpy("mel").shape[2]]
        time.sleep(3.0)   # between sentences
        client.async_stream_infer("token2mel", infer_inputs(start_tensors(23)), sequence_id=6_101,
                                  sequence_start=True)
        _, refused = events.get(timeout=60)
        assert refused is not None and answer_of(str(refused)).disposition is Disposition.BUSY, str(refused)
        for lo, hi, end in ((20, 35, False), (35, len(u.speech_tokens), True)):
            client.async_stream_infer("token2mel", infer_inputs(request_arrays(u.speech_tokens[lo:hi])),
                                      sequence_id=6_100, sequence_end=end)
            result, error = events.get(timeout=60)
            assert error is None, f"the stream that came back after its pause: {error}"
            offsets.append(int(result.as_numpy("frame_offset")[0, 0]))
            frames.append(result.as_numpy("mel").shape[2])
    finally:
        client.stop_stream()
        client.close()
    assert offsets == list(np.cumsum([0] + frames[:-1])), "every frame in order"
    assert sum(frames) == 2 * len(u.speech_tokens)


def test_a_pod_is_ready_for_traffic_only_once_its_solver_has_priced_its_work(tmp_path):
    """``s3flow.server.drain ready --priced`` (the Deployment's readiness probe; issue 48: a burst sent to a server
    just ready went in before its price). Started without the estimator (explicit model control), the solver cannot
    calibrate: Triton answers ready, the probe does not; once the estimator is loaded, the calibration prices the
    work and the probe passes."""
    from s3flow.server.drain import ready
    from s3flow.server.metrics_reader import priced

    flow = load_flow(write_random_checkpoint(tmp_path / "ckpt.safetensors", FlowConfig.small(), seed=9))
    write_repository(tmp_path / "repo", flow, RepositorySettings(solver=SolverSettings.of(max_steps=20), ort_threads=1))
    with TritonServer(tmp_path / "repo", log_file=tmp_path / "server.log", model_control_mode="explicit",
                      load_models=["token2mel", "admission", "cfm_solver", "flow_encoder"], background_stop=True) as srv:
        http, metrics = f"http://{srv.http_url}", f"127.0.0.1:{srv.metrics_port}"
        assert ready(http, ""), "Triton is ready"
        time.sleep(1.0)
        assert not priced(metrics) and not ready(http, "", metrics), "no estimator, no price, not ready"
        srv.client().load_model("estimator")
        t0 = time.monotonic()
        while not ready(http, "", metrics):
            assert time.monotonic() - t0 < 60, "the calibration never priced the work: " + srv.log_tail()
            time.sleep(0.25)
        assert priced(metrics)


def test_the_admission_and_onnx_runtime_stubs_never_load_torch(server):
    """Issue 49: a stub that imports torch starts ~1 s slower and holds ~250 MiB more (results/stub_imports.md);
    admission and the ONNX Runtime models (the estimator, the encoder, the CPU host's vocoder) need none of it,
    after their setup and after serving (this module's streams have passed through them by now). The solver
    (its engine is torch) does load it."""
    from s3flow.server.healing import stubs

    def torch_loaded(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()

    by_model = {model: torch_loaded(pid) for pid, model in stubs(server.pid).items()}
    assert {"admission", "estimator", "flow_encoder", "vocoder", "cfm_solver"} <= set(by_model), by_model
    assert not any(by_model[m] for m in ("admission", "estimator", "flow_encoder", "vocoder")), by_model
    assert by_model["cfm_solver"], "the check reads what it claims: the solver's stub has torch mapped"
