"""Nothing accepted is lost at overload (issue 39.3): a real tritonserver with admission by capacity off takes
far more streams at once than it can keep up with, and every one of them completes, every frame once, in order.

What lost them (found on the trained teacher, token2wav, 32 at once: 20-24 of 32 answered "not active ... evicted
after 5.0 s idle"; here, with the idle timeout cut to 1 s so that these 2 cores' queues outlast it as the 5 s
default's do at 5 C, 20 of 32 through either ensemble; run at 2 s since two pytest workers share the host): a
FIFO execute takes a batch from Triton's queue and serves it one length bucket after another; the solver counted a
request as arrived when the execute began, so the reaper's thread took a stream for idle whose chunk was in the
execute's hands, not yet served. Requests are now counted from admission to the solver when their execute is over
(``s3flow.serving.arrivals.OnTheWay``).
"""
from __future__ import annotations

import threading

import pytest

from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.flow import FlowConfig
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.vocoder import VocoderConfig, random_vocoder
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.server.metrics_reader import metric_sum, read_metrics
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterances
from s3flow_client.stream import StreamError

pytestmark = pytest.mark.server
STREAMS = 32
IDLE_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("overload")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=9))
    # 2 s: at 1 s, 2 of 32 token2wav streams were taken for idle once under two pytest workers (the host shared with
    # another module's server; whether a client's next chunk came that late or the solver's view of the vocoder's
    # delivery lagged was not found: open end); the queues of 32 at once still outlast 2 s (asserted below)
    settings = RepositorySettings(solver=SolverSettings.of(utilization_target=0.0, idle_timeout_s=IDLE_S), ort_threads=1)
    write_repository(root / "repo", flow, settings, vocoder=random_vocoder(VocoderConfig.small(), seed=3))
    with TritonServer(root / "repo", log_file=root / "server.log", background_stop=True) as srv:
        yield srv


def at_once(url: str, model: str, n: int) -> list:
    utts = demo_utterances(n, 3.0, chunk=15, seed=90)
    out: list = [None] * n

    def one(k):
        try:
            [out[k]] = StreamingClient(url, model, timeout_s=300, max_retries=0, max_resumes=0).synthesize([utts[k]])
        except StreamError as exc:
            out[k] = str(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("model", ["token2mel", "token2wav"])
def test_every_stream_accepted_at_overload_completes(server, model):
    out = at_once(server.grpc_url, model, STREAMS)
    lost = [r for r in out if isinstance(r, str)]
    dropped = metric_sum(read_metrics(f"127.0.0.1:{server.metrics_port}"), "s3flow_sequences_dropped_total")
    print(f"\n{model}: {STREAMS} at once with an idle timeout of {IDLE_S} s: {len(lost)} lost, {dropped:.0f} dropped in all")
    assert not lost, lost[:3]
    for r in out:
        assert r.error is None and r.mel.shape[1] == r.frames_expected
    # the test still has teeth: chunks waited in the server longer than the idle timeout (where the old count
    # took their streams for idle)
    slowest = max(max(r.chunk_latencies_s) for r in out)
    print(f"slowest chunk {slowest:.1f} s (idle timeout {IDLE_S} s)")
    assert slowest > IDLE_S
