"""Nothing lost when a server goes away: two real tritonservers behind the client's address list.

Eight utterances stream to server A; A is killed (SIGKILL) or drained (SIGTERM to its supervisor) in the
middle. Every utterance must complete with every frame once, in order, and equal an undisturbed run on B
(same seeds) within the client's replay tolerance.
"""
import os
import signal
import threading
import time

import numpy as np
import pytest

from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.server.drain import live_sequences, ready
from s3flow.serving.draining import closing_probe
from s3flow.model.flow import FlowConfig
from s3flow.engine.settings import SolverSettings
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance, demo_utterances

pytestmark = pytest.mark.server
N_UTTERANCES = 8
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("failover")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=4))
    # no pricing at admission (utilization_target 0): a loaded host's price refused the resumed utterances on
    # both servers (two pytest workers); capacity has its own tests
    settings = RepositorySettings(solver=SolverSettings.of(max_steps=20, idle_timeout_s=5.0, utilization_target=0.0),
                                  batching=Batching(max_queue_delay_us=2000), ort_threads=1)
    write_repository(root / "repo", flow, settings)
    return root / "repo"


@pytest.fixture(scope="module")
def server_b(repo):
    with TritonServer(repo, log_file=repo.parent / "b.log", background_stop=True) as srv:
        yield srv


def utterances():
    return demo_utterances(N_UTTERANCES, 2.0, chunk=10, steps=4, seed=60)   # 5 chunks of 10 tokens each


@pytest.fixture(scope="module")
def undisturbed(server_b):
    return StreamingClient(server_b.grpc_url, timeout_s=120).synthesize(utterances())


def after_chunks(n: int, action):
    """A progress callback that runs ``action`` once ``n`` chunks (of all utterances) have arrived."""
    count = iter(range(1, 1 << 30))
    return lambda _: action() if next(count) == n else None


def check_complete(results, undisturbed):
    for got, want in zip(results, undisturbed):
        assert got.error is None and got.mel.shape == want.mel.shape == (80, 100)
        assert sum(got.chunk_frames) == 100                      # every frame once (the client checks order)
        assert np.abs(got.mel - want.mel).max() <= TOLERANCE    # the same synthesis as undisturbed


def test_a_server_killed_mid_stream_loses_nothing(repo, server_b, undisturbed, tmp_path):
    with TritonServer(repo, log_file=tmp_path / "a.log") as a:
        killed = {}

        def kill():
            killed["t"] = time.monotonic()
            os.killpg(a.pid, signal.SIGKILL)   # the server leads its own process group: stubs too

        client = StreamingClient([a.grpc_url, server_b.grpc_url], timeout_s=120)
        results = client.synthesize(utterances(), progress=after_chunks(12, kill))
        took = time.monotonic() - killed["t"]
    check_complete(results, undisturbed)
    moved = [r for r in results if r.resumes]
    print(f"\nSIGKILL: {len(moved)} utterances resumed on B, {sum(r.replayed_frames for r in results)} frames "
          f"replayed (max diff {max(r.replay_max_diff for r in results):.2g}), all done {took:.1f} s after the kill")
    assert moved and all(server_b.grpc_url in r.resumes[0] for r in moved)
    assert sum(r.replayed_frames for r in moved) > 0   # frames delivered by A were checked against B's, not resent


def test_a_drained_server_finishes_its_utterances_and_sends_new_ones_elsewhere(repo, server_b, undisturbed, tmp_path):
    a = TritonServer(repo, log_file=tmp_path / "a.log", drain_s=60.0)
    with a:
        late: dict = {}
        metrics = f"http://127.0.0.1:{a.metrics_port}/metrics"

        def late_utterance():  # a new utterance that arrives while A drains: A refuses it, B serves it
            late["ready_during_drain"] = ready(f"http://{a.http_url}", str(a.drain_file))
            late["live"] = live_sequences(metrics)
            u = demo_utterance(1.0, seed=70)
            u.n_timesteps = 4
            [late["result"]] = StreamingClient([a.grpc_url, server_b.grpc_url], timeout_s=60).synthesize([u])

        def drain():
            late["t"] = time.monotonic()
            os.kill(a.pid, signal.SIGTERM)
            while not a.draining:
                time.sleep(0.01)
            late["thread"] = threading.Thread(target=late_utterance)
            late["thread"].start()

        client = StreamingClient([a.grpc_url, server_b.grpc_url], timeout_s=120)
        results = client.synthesize(utterances(), progress=after_chunks(12, drain))
        late["thread"].join(60)
        code = a.process.wait(60)
        stopped = time.monotonic() - late["t"]
    check_complete(results, undisturbed)
    # the utterances in flight finished on A: none moved (admission prices nothing here, so none was refused busy)
    assert not any(r.resumes for r in results), [r.resumes for r in results]
    assert code == 0 and stopped < 60               # then A stopped by itself, well inside the deadline
    assert late["ready_during_drain"] is False and late["live"] > 0
    got = late["result"]
    assert got.error is None and got.mel.shape == (80, 50)
    assert len(got.resumes) == 1 and "draining" in got.resumes[0] and server_b.grpc_url in got.resumes[0]
    print(f"\nSIGTERM: drained and stopped {stopped:.1f} s after the signal; the late utterance went to B")


def test_a_drain_deadline_too_short_moves_the_utterances_still_open(repo, server_b, undisturbed, tmp_path):
    """At the deadline A stops while utterances are open: their next model calls fail with 'Server not
    ready' (Triton 2.51 keeps the stream, its models refuse), and the client resumes them on B."""
    a = TritonServer(repo, log_file=tmp_path / "a.log", drain_s=0.2)
    with a:
        def stop_past_deadline():   # the client holds its next chunks until A's drain is over (else a fast host
            os.kill(a.pid, signal.SIGTERM)   # may finish all eight utterances inside the 0.2 s)
            t0, closing = time.monotonic(), closing_probe(str(a.drain_file))
            while not closing():
                assert time.monotonic() - t0 < 30, "A's drain did not reach its closing phase"
                time.sleep(0.01)

        client = StreamingClient([a.grpc_url, server_b.grpc_url], timeout_s=120)
        results = client.synthesize(utterances(), progress=after_chunks(12, stop_past_deadline))
    check_complete(results, undisturbed)
    moved = [r for r in results if r.resumes]
    assert moved and all(server_b.grpc_url in r.resumes[0] for r in moved)
    print(f"\ndrain deadline 0.2 s: {len(moved)} utterances resumed on B: {moved[0].resumes[0][:160]}")
