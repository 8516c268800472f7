"""Short versions of ``scripts/load_test.py`` (its engine: ``s3flow_tools.bench.load``) against a real
tritonserver: bounded load and a memory soak.

The full run (16 streams x 20 utterances, 1,000 utterances for memory) is ``scripts/load_test.py``; its
figures are in ``results/load_test.md``.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamResult
from s3flow_tools.bench.load import (check_chunks, load_utterance, memory_utterance, run_load, run_memory,
                                      solver_stub_pid)
from s3flow_tools.bench.repos import load_test_repository

ROOT = Path(__file__).resolve().parents[1]

#: allowed growth of the solver's RSS over 150 short utterances after warm-up; a leak of each utterance's
#: state (prompt mel, prompt noise, noised_mels: about 20 KB for these) would add about 3 MiB
RSS_BOUND_MB = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    repo = load_test_repository(root, streams=4)
    with TritonServer(repo, log_file=root / "server.log", background_stop=True) as srv:
        srv.stub_pid = solver_stub_pid(srv.pid)
        srv.metrics_url = f"127.0.0.1:{srv.metrics_port}"
        assert srv.stub_pid is not None, "no cfm_solver stub among the server's children"
        yield srv


@pytest.mark.server
def test_short_load_loses_nothing_and_matches_outputs_alone(server):
    report = run_load(server.grpc_url, streams=4, utterances=3, steps=2, time_limit_s=120, check_outputs=2,
                      stub_pid=server.stub_pid, metrics_url=server.metrics_url)
    assert report.ok, (report.errors, report.frame_errors, report.output_mismatches, report.not_run)
    assert report.done == 12 and report.chunks == sum(len(load_utterance(i, 2).chunks) for i in range(12))
    assert report.live_after == 0, "sequences left live after every utterance ended"
    print(f"\nshort load: chunk latency p50 {report.percentile_ms('chunk_latencies', 50):.0f} ms, "
          f"p99 {report.percentile_ms('chunk_latencies', 99):.0f} ms, {report.chunks / report.wall_s:.1f} chunks/s")


@pytest.mark.server
def test_solver_memory_stays_flat_over_150_utterances(server):
    # warm-up 120: CI saw a one-time +6-7 MiB once between the 30th and the 60th utterance, once between the
    # 60th and the 90th, flat after both (first-use allocation, not growth: a leak keeps growing); a step after
    # the warm-up is not read as growth either (MemoryReport.growth: the samples' robust trend)
    report = run_memory(server.grpc_url, {"cfm_solver": server.stub_pid}, utterances=150, steps=1, warmup=120,
                        samples=5, metrics_url=server.metrics_url)
    assert not report.errors, report.errors[:3]
    assert report.live_after == 0
    print(f"\nsolver RSS over 150 utterances: {report.start_mb():.1f} -> {report.end_mb():.1f} MiB "
          f"(growth {report.growth():+.2f}, peak {report.peak_growth():+.2f} MiB)")
    assert report.growth_mb <= RSS_BOUND_MB, report.samples


def _result(u, chunk_frames):
    frames = sum(chunk_frames)
    return StreamResult(mel=np.zeros((80, frames), np.float32), chunk_latencies_s=[0.0] * len(chunk_frames),
                        chunk_frames=list(chunk_frames), wall_s=0.0)


def test_memory_growth_follows_the_samples_trend_not_one_noisy_sample_or_a_first_use_step():
    """Flat runs whose samples wander 3 MiB (CI's: 258.1 261.0 258.3 258.3 260.1 260.1, end less start 2.008) or
    alternate by 1.5 MiB, and ones that step up once and stay (255.8 261.1 259.5 263.2 259.7 259.7: +2.77 by a
    least-squares line; 258.2 258.1 260.5 260.5 260.6 260.6: +2.39 by the median of every two samples' slopes) are
    within the bound; 20 kB more per utterance is above it, with noise on one sample, after a step, or
    alternating."""
    from s3flow_tools.bench.load import MemoryReport

    def report(rss):
        return MemoryReport(utterances=150, warmup=120, steps=1,
                            samples=[(30 * k, {"cfm_solver": m}) for k, m in enumerate(rss)])

    for flat in ([258.09, 261.04, 258.30, 258.35, 260.09, 260.09], [255.8, 261.1, 259.5, 263.2, 259.7, 259.7],
                 [258.18, 258.11, 260.49, 260.52, 260.55, 260.57],   # (a step after the second sample, -n 2 here)
                 [258.0, 259.5, 258.0, 259.5, 258.0, 259.5]):         # (alternating)
        assert report(flat).growth_mb <= RSS_BOUND_MB, flat
    for leak in ([258.0 + 0.6 * k + (1.5 if k == 1 else 0.0) for k in range(6)],
                 [258.0 + 0.6 * k + (5.0 if k else 0.0) for k in range(6)],
                 [258.0 + 0.6 * k + (4.0 if k > 1 else 0.0) for k in range(6)],
                 [258.0 + 0.6 * k + (1.5 if k % 2 == 0 else 0.0) for k in range(6)]):
        assert report(leak).growth_mb > RSS_BOUND_MB, leak


def test_frame_accounting_catches_missing_and_extra_frames():
    u = memory_utterance(0, 1)                       # 8 tokens in chunks 4 + 4
    assert check_chunks(u, _result(u, [2, 14])) is None
    assert "chunk 0" in check_chunks(u, _result(u, [3, 13]))
    assert "chunk 1" in check_chunks(u, _result(u, [2, 12]))
    assert "responses" in check_chunks(u, _result(u, [16]))
    v = load_utterance(3, 2)
    good = []
    tokens = made = 0
    for k, size in enumerate(v.chunks):
        tokens += size
        now = 2 * tokens if k == len(v.chunks) - 1 else max(2 * tokens - 6, made)
        good.append(now - made)
        made = now
    assert check_chunks(v, _result(v, good)) is None
    assert check_chunks(v, _result(v, good[:-1] + [good[-1] + 2])) is not None


def test_load_test_help_has_a_runnable_example():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "load_test.py"), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "scripts/load_test.py --streams 4 --utterances 3" in out.stdout and "--memory-utterances" in out.stdout


@pytest.mark.server
def test_memory_comes_back_after_a_long_utterance(server):
    """One 1,490-token utterance sent as one chunk (the largest request the limits allow) once raised the
    server from 0.83 to 1.75 GiB for good (ONNX Runtime's arena and memory-pattern cache, glibc's heap).
    Bound: within 15 % of the level before it, measured over the server and its stubs (2026-12-07, on the code
    before and after issue 49's serving object alike: 1.09-1.107x here, where 10 % had held on earlier hosts; the
    regression it guards against was 2.1x)."""
    from s3flow_client import StreamingClient
    from s3flow_client.demo import demo_utterance

    client = StreamingClient(server.grpc_url, timeout_s=300)
    short = [demo_utterance(3.0, seed=90 + i) for i in range(3)]
    for u in short:
        u.n_timesteps = 2
    client.synthesize(short)
    client.synthesize(short)
    before = server.rss_bytes()
    long = demo_utterance(1490 / 25, seed=93)
    long.n_timesteps, long.chunks = 2, [1490]
    [r] = client.synthesize([long])
    assert r.mel.shape == (80, 2980)
    client.synthesize(short)
    after = server.rss_bytes()
    print(f"\nserver + stubs: {before / 2**30:.3f} GiB before, {after / 2**30:.3f} GiB after a 1,490-token chunk")
    assert after <= 1.15 * before
