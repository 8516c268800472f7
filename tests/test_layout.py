"""The shipped CPU layout on a real tritonserver (results/layout.md): two ``cfm_solver`` instances beside two
``estimator`` instances of half the cores each. Streams at once spread over both solver instances and every frame
arrives in order; each instance writes its load report, and admission's capacity is the instances' summed, as
the gauge says; the token2wav path is served too. The rest of the suite runs one instance of each (conftest)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.flow import FlowConfig
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.vocoder import VocoderConfig, random_vocoder
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.serving.load import LoadBoard, LoadReport
from s3flow.server.metrics_reader import metric_sum, read_metrics
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance

pytestmark = pytest.mark.server


def gauge(server, name: str, **labels) -> float:
    return metric_sum(read_metrics(f"127.0.0.1:{server.metrics_port}"), name, **labels)


@pytest.fixture(scope="module")
def server(tmp_path_factory, shipped_layout):
    root = tmp_path_factory.mktemp("layout")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=4))
    # admission off: these tests check Triton's spread of streams over the instances, which admission's pacing on
    # a slower host serializes (CI: refused STARTs retried one after another, all six went to one instance)
    settings = RepositorySettings(solver=SolverSettings.of(max_steps=20, idle_timeout_s=60.0), admission=False)
    assert (settings.batching.solver_instances, settings.batching.estimator_instances) == (2, 2), settings.batching
    write_repository(root / "repo", flow, settings, vocoder=random_vocoder(VocoderConfig.small(), seed=4))
    with TritonServer(root / "repo", log_file=root / "server.log", background_stop=True) as srv:
        loads = LoadBoard(LoadBoard.default_folder(srv.pid))
        t0 = time.monotonic()
        while not loads.read().known or len([r for r in loads.read().reports if r.kind == "solver"]) < 2:
            assert time.monotonic() - t0 < 90, "the two solver instances never priced their work: " + srv.log_tail()
            time.sleep(0.25)
        yield srv


def test_the_shipped_cpu_layout_is_two_solver_and_two_estimator_instances(server):
    client = server.client()
    for model in ("cfm_solver", "estimator"):
        groups = client.get_model_config(model).config.instance_group
        assert sum(g.count for g in groups) == 2, (model, groups)


def test_streams_at_once_spread_over_both_solver_instances_and_every_frame_arrives_in_order(server):
    """Six streams held at once: Triton gives each new sequence the lowest free slot number over the instances'
    batchers, so the second one held goes to the other instance."""
    utts = [demo_utterance(1.2, seed=20 + k) for k in range(6)]
    held, done = {}, threading.Event()

    def watch():   # which solver instance holds which stream (answered or not), from their load reports
        board = LoadBoard(LoadBoard.default_folder(server.pid)).board
        while not done.is_set():
            for name, (_, payload) in board.read().items():
                if name.startswith("cfm_solver"):
                    report = LoadReport.from_json(payload.decode())
                    held.setdefault(name, set()).update(report.streams, report.waiting)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = StreamingClient(server.grpc_url, "token2mel", timeout_s=300).synthesize(utts)
    finally:
        done.set()
        watcher.join()
    for u, r in zip(utts, results):
        assert r.error is None and r.mel.shape[1] == 2 * len(u.speech_tokens), r.error
        assert np.isfinite(r.mel).all()
    assert len(set().union(*held.values())) == len(utts), f"not every stream was seen held: {held}"
    busy = {name: ids for name, ids in held.items() if ids}
    assert len(busy) == 2, f"streams went to one solver instance only: {held}"


def test_the_capacity_admission_reads_is_the_instances_summed_as_the_gauge_says(server):
    load = LoadBoard(LoadBoard.default_folder(server.pid)).read()
    solvers = [r for r in load.reports if r.kind == "solver"]
    assert len(solvers) == 2 and all(r.capacity > 0 for r in solvers)
    assert load.capacity == pytest.approx(sum(r.capacity for r in solvers))
    published = gauge(server, "s3flow_capacity_audio_seconds_per_second", ensemble="token2mel")
    assert published == pytest.approx(load.capacity, rel=0.5), "each instance publishes its own; the gauge sums them"


def test_token2wav_is_served_under_the_shipped_layout(server):
    u = demo_utterance(1.5, seed=31)
    [r] = StreamingClient(server.grpc_url, "token2wav", timeout_s=300).synthesize([u])
    assert r.error is None and r.audio is not None and r.audio.size == 480 * 2 * len(u.speech_tokens)
