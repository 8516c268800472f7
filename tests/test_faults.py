"""Faults and sequence lifecycle against a real tritonserver; security checks of loading and binding.

One server per module (``model_control_mode='explicit'``, so models can be unloaded and loaded back), small
seeded model, idle timeout 2 s, at most 3 live sequences. The solver's live-sequence count is read from its
Prometheus gauge ``s3flow_live_sequences`` on the server's metrics port (``s3flow_sequences_dropped_total`` counts
states dropped before their END, by reason).

Measured with Triton 2.51 (the pytriton 0.7.0 wheel): ``request.is_cancelled()`` works in the python
backend for a request sent to ``cfm_solver`` directly, but the ensemble does not pass a client's
cancellation on to a step already running (it checks between steps only, triton-inference-server/core
PR #263), so through ``token2mel`` a vanished client's chunk runs to its end and the state is freed by the
idle eviction; both paths are tested.
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from s3flow_contract.tensors import request_arrays
from s3flow.model.checkpoint import load_flow, read_checkpoint
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.engine.settings import SolverSettings
from s3flow.server.metrics_reader import metric_sum, read_metrics
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow.server.triton_server import TritonServer, free_port
from s3flow_client import StreamError, StreamingClient
from s3flow_client.demo import demo_utterance
from s3flow_client.wire import infer_inputs
from s3flow_tools.bench.killed_client import kill_mid_stream

ROOT = Path(__file__).resolve().parents[1]

IDLE_S = 2.0
GRACE_S = 5.0   # Triton forgets a sequence GRACE_S after the solver (chunks here take well under a second)
# no pricing at admission (utilization_target 0): what is refused here is the cap of 3 live sequences, whatever the
# host's load (under two pytest workers the price of a loaded host refused STARTs as busy first)
SOLVER = SolverSettings.of(max_steps=20, max_utterance_frames=1000, max_live_sequences=3, idle_timeout_s=IDLE_S,
                           utilization_target=0.0)
MODELS = ["token2mel", "admission", "cfm_solver", "flow_encoder", "estimator"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=3))
    settings = RepositorySettings(solver=SOLVER, batching=Batching(max_queue_delay_us=2000), ort_threads=1,
                                  triton_idle_grace_s=GRACE_S)
    write_repository(root / "repo", flow, settings)
    return root / "repo"


@pytest.fixture(scope="module")
def server(repo):
    with TritonServer(repo, log_file=repo.parent / "server.log", model_control_mode="explicit",
                      load_models=MODELS, background_stop=True) as srv:
        yield srv


# ------------------------------------------------------------------------------------------ helpers
def solver_metrics(server) -> tuple[float, dict]:
    """(live sequences, {reason: dropped count}) from the solver's metrics."""
    metrics = read_metrics(f"127.0.0.1:{server.metrics_port}")
    dropped = {dict(labels)["reason"]: v for (name, labels), v in metrics.items()
               if name == "s3flow_sequences_dropped_total"}
    return metric_sum(metrics, "s3flow_live_sequences"), dropped


def wait_live(server, want: float, timeout: float) -> float:
    """Poll the live gauge until it equals ``want``; return the seconds it took (fail after ``timeout``)."""
    t0 = time.monotonic()
    while True:
        try:
            live, _ = solver_metrics(server)
        except OSError as exc:  # the metrics port opens a moment after the server reports ready
            live = f"unreadable ({exc})"
        if live == want:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"live sequences {live}, expected {want} within {timeout} s"
        time.sleep(0.1)


def tensors(u, lo: int, hi: int, start: bool, steps: int | None = None, seed: int | None = None) -> dict:
    """The chunk speech_tokens[lo:hi] of u; a START carries u's prompt (not its seed: the server's default)."""
    if not start:
        return request_arrays(u.speech_tokens[lo:hi])
    return request_arrays(u.speech_tokens[lo:hi], start=True, prompt_tokens=u.prompt_tokens, prompt_mel=u.prompt_mel,
                          speaker_embedding=u.speaker_embedding, n_timesteps=steps, seed=seed)


def infer(server, seq_id: int, start: bool, end: bool, values: dict, model: str = "token2mel"):
    return server.client().infer(model, infer_inputs(values), sequence_id=seq_id, sequence_start=start,
                                 sequence_end=end)


class RawStream:
    """One gRPC stream driven by hand, to vanish in the middle of a chunk."""

    #: a vanish this soon after an answer waits out the rest: Triton 2.51 leaks a request whose answer a
    #: cancellation crosses on its way out (tests/test_stream_close.py), and its ensemble then never unloads
    AFTER_ANSWER_S = 0.2

    def __init__(self, server, model: str):
        self.model, self.events, self.answered_at = model, queue.Queue(), 0.0
        self.client = server.client()
        self.client.start_stream(callback=self._event)

    def _event(self, result, error) -> None:
        self.answered_at = time.monotonic()
        self.events.put((result, error))

    def send(self, seq_id: int, start: bool, values: dict) -> None:
        self.client.async_stream_infer(self.model, infer_inputs(values), sequence_id=seq_id, sequence_start=start)

    def response(self, timeout: float = 30.0):
        result, error = self.events.get(timeout=timeout)
        assert error is None, error
        return result

    def vanish(self) -> None:
        time.sleep(max(0.0, self.answered_at + self.AFTER_ANSWER_S - time.monotonic()))
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def estimator_calls(server) -> int:
    return int(server.client().get_inference_statistics("estimator").model_stats[0].inference_count)


# ------------------------------------------------------------------------------------------ models unloaded
@pytest.mark.server
@pytest.mark.parametrize("model", ["estimator", "flow_encoder"])
def test_unloaded_model_gives_a_clear_error_and_loading_it_back_recovers(server, model):
    u = demo_utterance(1.2, seed=50, noise_seed=1)
    u.chunks, u.n_timesteps = [10, 20], 3
    client = StreamingClient(server.grpc_url, timeout_s=30)
    [before] = client.synthesize([u])
    server.client().unload_model(model)
    try:
        t0 = time.monotonic()
        with pytest.raises(StreamError) as info:
            client.synthesize([u])
        elapsed = time.monotonic() - t0
        assert f"model '{model}'" in str(info.value) and "not ready" in str(info.value), str(info.value)
        assert elapsed < 5, f"the error took {elapsed:.1f} s"
        assert info.value.results[0].mel.size == 0
        wait_live(server, 0, 2)  # the failed sequence's state was dropped
    finally:
        server.client().load_model(model)
    [after] = client.synthesize([u])
    np.testing.assert_allclose(after.mel, before.mel, atol=1e-5, rtol=0)


@pytest.mark.server
def test_a_failed_chunk_leaves_the_sequence_as_before_and_can_be_sent_again(tmp_path):
    """The estimator goes away in the middle of an utterance (bounded-context mode): that chunk fails with
    UNAVAILABLE, the sequence stays as before it, and once the estimator is back the same chunk, sent
    again, continues the utterance exactly as an undisturbed one (and as the in-process engine). The
    streaming client retries such chunks by itself."""
    from helpers import make_engine, stream_in_process
    solver = SOLVER.replace(idle_timeout_s=60.0, context_frames=20)
    flow = load_flow(write_random_checkpoint(tmp_path / "ckpt.safetensors", FlowConfig.small(), seed=3))
    write_repository(tmp_path / "repo", flow, RepositorySettings(solver=solver, ort_threads=1))
    u = demo_utterance(1.6, seed=51, noise_seed=2)
    u.n_timesteps = 3
    bounds = [(0, 10), (10, 22), (22, 40)]

    def send(srv, seq_id, k):
        lo, hi = bounds[k]
        values = tensors(u, lo, hi, k == 0, steps=3, seed=u.seed if k == 0 else None)
        r = infer(srv, seq_id, k == 0, k == len(bounds) - 1, values)
        return int(r.as_numpy("frame_offset")[0, 0]), r.as_numpy("mel")[0]

    with TritonServer(tmp_path / "repo", log_file=tmp_path / "server.log", model_control_mode="explicit",
                      load_models=MODELS, background_stop=True) as srv:
        undisturbed = [send(srv, 11, k) for k in range(3)]
        got = [send(srv, 12, 0)]
        srv.client().unload_model("estimator")
        with pytest.raises(InferenceServerException) as info:
            send(srv, 12, 1)
        assert "UNAVAILABLE" in str(info.value.status()) and "send it again" in str(info.value), str(info.value)
        srv.client().load_model("estimator")
        got += [send(srv, 12, 1), send(srv, 12, 2)]

        # the client does it by itself: two utterances on one gRPC stream, the estimator goes away after
        # the first responses and comes back a second later; both utterances complete, each equal to an
        # undisturbed run, and the retries are reported
        utts = [demo_utterance(2.0, seed=52 + i, noise_seed=i) for i in range(2)]
        for x in utts:
            x.n_timesteps, x.chunks = 3, [10, 10, 10, 20]
        client = StreamingClient(srv.grpc_url, timeout_s=120, max_retries=6, retry_backoff_s=0.2)
        calm = client.synthesize(utts)
        responses = []

        def outage(n):
            responses.append(n)
            if len(responses) == 2:
                srv.client().unload_model("estimator")
                threading.Timer(1.0, lambda: srv.client().load_model("estimator")).start()

        stormy = client.synthesize(utts, progress=outage)
    assert sum(len(r.retries) for r in stormy) >= 1, "the outage was not seen"
    assert all("send" in e and "again" in e for r in stormy for e in r.retries), [r.retries for r in stormy]
    for a, b in zip(stormy, calm):
        np.testing.assert_allclose(a.mel, b.mel, atol=1e-5, rtol=0)
    assert [o for o, _ in got] == [o for o, _ in undisturbed] == [0, 14, 38]
    for (_, a), (_, b) in zip(got, undisturbed):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    u.chunks = [hi - lo for lo, hi in bounds]
    [local] = stream_in_process(make_engine(flow, solver), [u], [u.chunks], rules=solver.rules)
    for (_, a), r in zip(got, local):
        np.testing.assert_allclose(a, r.mel, atol=5e-4, rtol=0)


# ------------------------------------------------------------------------------------------ lifecycle
@pytest.mark.server
def test_cancel_mid_chunk_stops_the_solver_between_steps_and_drops_the_state(server):
    """Sent to cfm_solver directly, a cancelled request is seen between Euler steps."""
    wait_live(server, 0, IDLE_S + 3)
    u = demo_utterance(20.0, seed=51)
    stream = RawStream(server, "cfm_solver")
    stream.send(801, True, tensors(u, 0, 10, True, steps=20))
    stream.response()
    _, dropped = solver_metrics(server)
    calls = estimator_calls(server)
    # 20 steps over ~1,030 frames: about 2 s (over ~530 frames, most of a second, the whole chunk was solved
    # before the cancellation reached the solver in 1 of 3 full suites on this host)
    stream.send(801, False, tensors(u, 10, 490, False))
    time.sleep(0.25)
    stream.vanish()
    took = wait_live(server, 0, 5)
    _, dropped_after = solver_metrics(server)
    assert dropped_after.get("cancelled", 0) == dropped.get("cancelled", 0) + 1
    ran = estimator_calls(server) - calls
    print(f"\ncancelled after {ran} of 20 Euler steps; state freed {took:.2f} s after the client left")
    assert ran < 20, "the solver ran every step of a cancelled request"


@pytest.mark.server
def test_client_vanishing_through_the_ensemble_frees_the_state_after_the_idle_timeout(server):
    wait_live(server, 0, IDLE_S + 3)
    u = demo_utterance(10.0, seed=52)
    stream = RawStream(server, "token2mel")
    stream.send(802, True, tensors(u, 0, 10, True, steps=20))
    stream.response()
    _, dropped = solver_metrics(server)
    stream.send(802, False, tensors(u, 10, 240, False))
    time.sleep(0.25)
    stream.vanish()
    assert solver_metrics(server)[0] == 1
    took = wait_live(server, 0, IDLE_S + 6)   # with no other request coming: the reaper thread evicts it
    _, dropped_after = solver_metrics(server)
    freed = {k: dropped_after.get(k, 0) - dropped.get(k, 0) for k in ("idle", "cancelled")}
    print(f"\nstate freed {took:.1f} s after the client left ({freed})")
    assert sum(freed.values()) == 1


def stream_in_background(server, u) -> threading.Thread:
    """Another client streaming ``u`` through token2mel while a test does something else."""
    thread = threading.Thread(target=lambda: StreamingClient(server.grpc_url, timeout_s=60).synthesize([u]))
    thread.start()
    return thread


#: a sequence whose client went is freed within the idle timeout plus this (the solver's reaper period, the
#: arrival slack of s3flow.serving.arrivals.OnTheWay and one chunk's time)
FREED_WITHIN_S = IDLE_S + 4.0


def wait_idle_drops(server, before: dict, more: int, timeout: float) -> float:
    """Poll ``s3flow_sequences_dropped_total{reason="idle"}`` until it is ``more`` above ``before``; the seconds it
    took (fail after ``timeout``)."""
    t0 = time.monotonic()
    while True:
        dropped = solver_metrics(server)[1].get("idle", 0) - before.get("idle", 0)
        if dropped >= more:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"{dropped} of {more} sequences evicted within {timeout} s"
        time.sleep(0.1)


@pytest.mark.server
@pytest.mark.parametrize("busy", [False, True], ids=["server-idle", "another-stream"])
def test_a_chunk_cancelled_between_admission_and_the_solver_does_not_keep_its_sequence(server, busy):
    """Issue 31, the race forced: a client goes after admission marked its next chunk and before the ensemble
    sent it on (the ensemble checks cancellation between its steps), so the mark's request never reaches the
    solver. The mark is written here exactly as admission writes it, into the server's folder; before the fix the
    sequence stayed live for good. With the server idle, or busy with another stream meanwhile, it is freed within
    the idle timeout of its last answer plus the slack."""
    from s3flow.serving.arrivals import ArrivalMarks

    wait_live(server, 0, IDLE_S + 3)
    u = demo_utterance(2.0, seed=61)
    stream = RawStream(server, "token2mel")
    seq = 841 + busy
    _, dropped = solver_metrics(server)
    stream.send(seq, True, tensors(u, 0, 10, True, steps=2))
    stream.response()
    answered = time.monotonic()
    ArrivalMarks(ArrivalMarks.default_folder("seen", server_pid=server.pid)).mark(seq)   # the next chunk's mark
    stream.vanish()
    other = None
    if busy:   # a stream of 10 chunks over the next seconds: the solver keeps picking up newer requests
        v = demo_utterance(4.0, seed=62)
        v.chunks, v.n_timesteps = [10] * 10, 4
        other = threading.Thread(target=lambda: StreamingClient(server.grpc_url, timeout_s=60).synthesize([v]))
        other.start()
    try:
        wait_idle_drops(server, dropped, 1, FREED_WITHIN_S + 2)
        freed = time.monotonic() - answered
    finally:
        if other is not None:
            other.join(60)
    print(f"\nfreed {freed:.1f} s after its last answer ({'another stream meanwhile' if busy else 'idle server'})")
    assert freed < FREED_WITHIN_S
    wait_live(server, 0, IDLE_S + 3)


@pytest.mark.server
def test_a_killed_client_is_freed_while_another_utterance_streams(server):
    """Issue 31, as it was seen: a client process SIGKILLed while its 3rd chunk is in flight, another client
    streaming an utterance right after, three times on one server: each killed sequence is freed within the idle
    timeout plus the slack of the kill (before the fix: 3 of 10 stayed live for good)."""
    wait_live(server, 0, IDLE_S + 3)
    for attempt in range(3):   # two answers in: the third chunk is on its way or being solved
        killed = kill_mid_stream(server.grpc_url, "token2mel", seed=70 + attempt, seconds=4.0)
        v = demo_utterance(2.0, seed=80 + attempt)
        v.chunks, v.n_timesteps = [10] * 5, 4
        [r] = StreamingClient(server.grpc_url, timeout_s=60).synthesize([v])
        assert r.error is None
        wait_live(server, 0, FREED_WITHIN_S + 2)
        freed = time.monotonic() - killed
        print(f"\nkill {attempt + 1}: freed {freed:.1f} s after the kill")
        assert freed < FREED_WITHIN_S + 1.0


@pytest.mark.server
def test_idle_sequence_is_evicted_and_a_later_chunk_gets_the_solvers_message(server):
    """The solver evicts a sequence idle for idle_timeout_s; Triton forgets it GRACE_S later, so a
    chunk sent in between still reaches the solver, whose message says what happened. The late chunk goes
    in the middle of that window, idle_timeout_s + grace / 2 after the START: without the grace (Triton's
    idle timeout equal to the solver's) Triton would have forgotten the sequence grace / 2 earlier and
    answer "must specify the START flag" itself; with it, Triton forgets it only grace / 2 later."""
    wait_live(server, 0, IDLE_S + 3)
    u = demo_utterance(1.0, seed=53)
    infer(server, 803, True, False, tensors(u, 0, 10, True, steps=2))
    answered = time.monotonic()   # both idle clocks started before this: at the START's arrival
    assert solver_metrics(server)[0] == 1
    took = wait_live(server, 0, IDLE_S + 3)
    assert took > IDLE_S - 0.5
    late = answered + IDLE_S + GRACE_S / 2
    time.sleep(max(late - time.monotonic(), 0.0))
    sent = time.monotonic() - answered
    with pytest.raises(InferenceServerException) as info:
        infer(server, 803, False, True, tensors(u, 10, 20, False))
    assert sent < IDLE_S + GRACE_S - 1.0, f"the late chunk went {sent:.1f} s after the START: too " \
        f"close to Triton's own timeout ({IDLE_S + GRACE_S} s) to tell the two apart"
    message = str(info.value)
    assert "sequence 803 is not active" in message and f"evicted after {IDLE_S} s idle" in message, message
    assert "START flag" not in message, message


@pytest.mark.server
def test_live_sequences_beyond_the_maximum_get_a_clear_error(server):
    wait_live(server, 0, IDLE_S + 3)
    u = demo_utterance(1.0, seed=54)
    start, more = tensors(u, 0, 10, True, steps=1), tensors(u, 10, 25, False)
    for seq in (811, 812, 813):
        infer(server, seq, True, False, start)
    with pytest.raises(InferenceServerException, match=r"too many live sequences \(3, max_live_sequences 3\)"):
        infer(server, 814, True, False, start)
    infer(server, 811, False, True, more)      # one ends: room for another
    infer(server, 814, True, False, start)
    for seq in (812, 813, 814):
        assert infer(server, seq, False, True, more).as_numpy("mel").shape == (1, 80, 2 * 25 - 14)
    assert solver_metrics(server)[0] == 0


@pytest.mark.server
def test_abandoned_and_refused_sequences_cannot_jam_the_server(server):
    """A client opens as many sequences as the solver holds, plus as many STARTs it refuses, and vanishes
    without END. A well-behaved utterance is answered at once (full: "retry in N s", never a silent wait in
    Triton's backlog) and starts within the reclaim time (idle_timeout_s + Triton's 5 s grace) + 1 s."""
    wait_live(server, 0, IDLE_S + 3)
    u = demo_utterance(1.0, seed=57)
    start = tensors(u, 0, 10, True, steps=1)
    rogue = RawStream(server, "token2mel")
    for seq in range(821, 827):   # 3 admitted, 3 refused: none ever ended
        rogue.send(seq, True, start)
    errors = [str(rogue.events.get(timeout=30)[1]) for _ in range(6)]
    assert sum("too many live sequences (3, max_live_sequences 3); retry in" in e for e in errors) == 3, errors
    rogue.vanish()
    t0 = time.monotonic()
    with pytest.raises(InferenceServerException, match=r"too many live sequences .*retry in \d") as info:
        infer(server, 830, True, True, start)   # a plain client: its START is answered, not queued
    answered = time.monotonic() - t0
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    good = demo_utterance(1.0, seed=58)
    good.n_timesteps = 1
    began = {}
    [r] = StreamingClient(server.grpc_url, timeout_s=60).synthesize(
        [good], progress=lambda _: began.setdefault("t", time.monotonic()))
    reclaim = IDLE_S + GRACE_S
    print(f"\nfull server answered in {answered:.2f} s; the new utterance began {began['t'] - t0:.2f} s after "
          f"the rogue vanished (reclaim {reclaim} s); retries {r.retries}")
    assert answered < 2.0 and r.error is None and r.mel.shape == (80, 50)
    assert r.retries and all("retry in" in m for m in r.retries)
    assert began["t"] - t0 < reclaim + 1.0


# ------------------------------------------------------------------------------------------ server gone
def after_chunks(n: int, action):
    """A StreamingClient progress callback that runs ``action`` once ``n`` chunks have arrived."""
    count = iter(range(1, 1 << 30))
    return lambda _: action() if next(count) == n else None


def long_utterance():
    u = demo_utterance(4.0, seed=55, noise_seed=2)
    u.chunks, u.n_timesteps = [10] * 10, 4
    return u


@pytest.mark.server
def test_hung_server_is_reported_within_the_response_timeout(server, monkeypatch):
    """SIGSTOP the server mid-stream: the client gives up after response_timeout_s, keeping its frames. Its
    stream is cancelled; a stream that got every answer is half-closed (``ServerStream.close``)."""
    from s3flow_client.channel import ServerStream

    closes, close = [], ServerStream.close
    monkeypatch.setattr(ServerStream, "close", lambda self, graceful=False, **kw: (
        closes.append("half-close" if graceful else "cancel"), close(self, graceful, **kw))[1])
    wait_live(server, 0, IDLE_S + 3)
    u = long_utterance()
    [full] = StreamingClient(server.grpc_url, timeout_s=60).synthesize([u])
    assert closes == ["half-close"]

    client = StreamingClient(server.grpc_url, timeout_s=60, response_timeout_s=2.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(StreamError) as info:
            client.synthesize([u], progress=after_chunks(3, lambda: os.kill(server.pid, signal.SIGSTOP)))
        elapsed = time.monotonic() - t0
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert closes == ["half-close", "cancel"]
    got = info.value.results[0]
    reached = sum(got.chunk_frames)
    assert reached == 14 + 20 + 20 and got.mel.shape[1] == reached
    assert f"reached frame {reached} of 200" in str(info.value) and "no response within 2.0 s" in str(info.value)
    assert elapsed < 2.0 + 5, f"gave up after {elapsed:.1f} s"
    np.testing.assert_array_equal(got.mel, full.mel[:, :reached])
    wait_live(server, 0, IDLE_S + 6)   # the server recovers and evicts the abandoned sequence


@pytest.mark.server
def test_server_killed_with_no_other_address_is_reported_with_the_frames_received(repo, tmp_path):
    """A second server on the same repository, killed with its stubs; the client has no other address to
    resume on (tests/test_failover.py has two): it tries the same address again, then reports."""
    with TritonServer(repo, log_file=tmp_path / "server.log") as srv:
        u = long_utterance()
        [full] = StreamingClient(srv.grpc_url, timeout_s=60).synthesize([u])
        stopped = {}

        def stop():
            stopped["t"] = time.monotonic()
            os.killpg(srv.pid, signal.SIGKILL)   # the server leads its own process group: stubs too

        with pytest.raises(StreamError) as info:
            StreamingClient(srv.grpc_url, timeout_s=60).synthesize([u], progress=after_chunks(3, stop))
        elapsed = time.monotonic() - stopped["t"]
        srv.process.wait(30)
    got = info.value.results[0]
    reached = sum(got.chunk_frames)
    print(f"\nerror after {elapsed:.2f} s: {info.value}")
    assert reached == 54 and got.mel.shape[1] == reached
    assert f"reached frame {reached} of 200" in str(info.value) and "gave up after 3 resumes" in str(info.value)
    assert len(got.resumes) == 3 and all(srv.grpc_url in r for r in got.resumes)
    assert elapsed < 10
    np.testing.assert_array_equal(got.mel, full.mel[:, :reached])


def test_no_server_at_the_address_is_a_stream_error_not_a_crash():
    u = demo_utterance(0.6, seed=56)
    t0 = time.monotonic()
    with pytest.raises(StreamError, match=r"reached frame 0 of 30 .*UNAVAILABLE") as info:
        StreamingClient(f"127.0.0.1:{free_port('127.0.0.1')}", timeout_s=20).synthesize([u])
    assert time.monotonic() - t0 < 10 and info.value.results[0].mel.size == 0


# ------------------------------------------------------------------------------------------ security
class _RunsCode:
    """Unpickling this calls exec(): what a malicious checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_checkpoint_with_pickled_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "code_ran"
    path = tmp_path / "s3gen.pt"
    torch.save({"flow.encoder_proj.weight": torch.zeros(80, 512), "payload": _RunsCode(marker)}, path)
    with pytest.raises(pickle.UnpicklingError, match="exec"):
        read_checkpoint(path)
    assert not marker.exists()
    # the payload is real: an unrestricted load runs it
    torch.load(path, weights_only=False)
    assert marker.read_text() == "ran"


def test_servers_bind_loopback_unless_told_otherwise(tmp_path):
    server = TritonServer(tmp_path, grpc_port=1, http_port=2, metrics_port=3)
    cmd = server.command()
    for endpoint in ("grpc", "http", "metrics"):
        assert f"--{endpoint}-address=127.0.0.1" in cmd
    assert "--grpc-address=0.0.0.0" in TritonServer(tmp_path, host="0.0.0.0", grpc_port=1, http_port=2,
                                                    metrics_port=3).command()
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "server.py"), "start", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "(default: 127.0.0.1)" in out.stdout, out.stdout
