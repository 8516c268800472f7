"""No sequence outlives its client, measured: issue 31's kill sequence, many times on one server, then its stop.

Example::

    .venv/bin/python -m s3flow_tools.measure.lifecycle                 # -> results/lifecycle.md (about 6 minutes)
    .venv/bin/python -m s3flow_tools.measure.lifecycle --runs 3 --out /tmp/lifecycle.md

A small token2wav repository on seeded random weights with the cpu target's defaults (idle timeout 5 s, Triton
keeps an idle sequence 5 + 30 s). Each run, as issue 31 saw it: a client closes its stream after 2 of 5 chunks
(token2mel), a second does the same (token2wav), both are evicted; then a client process is SIGKILLed while its
3rd chunk is on the way (token2wav) and another client streams a whole utterance right after. What is measured:
the seconds from the kill until the solver's and the vocoder's live gauges are back to 0 (the target: within
the idle timeout + 15 s, every run). After the runs the server is stopped as ``TritonServer.stop`` does: the
seconds it took and its exit code (before the fix: 30 s and SIGKILL).

Exits non-zero when a run is not freed in time or the stop is not a clean SIGTERM.
"""
from __future__ import annotations

import queue
import sys
import tempfile
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

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
from s3flow_tools.bench.killed_client import kill_mid_stream
from s3flow_tools.bench.report import machine
from s3flow_tools.measure.command import command

ROOT = Path(__file__).resolve().parents[3]
def utterance(seed: int, chunks: int = 5):
    u = demo_utterance(2.0, seed=seed)
    u.chunks, u.n_timesteps = [10] * (chunks - 1) + [len(u.speech_tokens) - 10 * (chunks - 1)], 4
    return u


def abandon(url: str, model: str, seq_id: int, u, chunks: int = 2) -> None:
    events = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put(error))
    lo = 0
    for k in range(chunks):
        client.async_stream_infer(model, infer_inputs(u.request(lo, lo + u.chunks[k], k == 0)), sequence_id=seq_id,
                                  sequence_start=k == 0)
        lo += u.chunks[k]
        error = events.get(timeout=60)
        if error is not None:
            raise RuntimeError(f"{model} sequence {seq_id}, chunk {k}: {error}")
    client.stop_stream()
    client.close()


def held(server) -> tuple[int, int]:
    m = read_metrics(f"127.0.0.1:{server.metrics_port}")
    return int(metric_sum(m, "s3flow_live_sequences")), int(metric_sum(m, "s3flow_vocoder_live_sequences"))


def wait_free(server, since: float, timeout: float) -> float:
    while held(server) != (0, 0):
        if time.monotonic() - since > timeout:
            return float("inf")
        time.sleep(0.1)
    return time.monotonic() - since


def one_run(server, k: int, limit_s: float) -> dict:
    url = server.grpc_url
    abandon(url, "token2mel", 9000 + 10 * k, utterance(10 * k + 1))
    abandon(url, "token2wav", 9001 + 10 * k, utterance(10 * k + 2))
    abandoned = wait_free(server, time.monotonic(), limit_s)
    killed = kill_mid_stream(url, "token2wav", seed=10 * k + 3, seconds=3.0)
    [r] = StreamingClient(url, "token2wav", timeout_s=60).synthesize([utterance(10 * k + 4)])
    if r.error is not None:
        raise RuntimeError(f"the utterance after the kill failed: {r.error}")
    return {"abandoned_freed_s": abandoned, "killed_freed_s": wait_free(server, killed, limit_s)}


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--runs", type=int, default=20, help="kill sequences on one server (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "lifecycle.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    settings = RepositorySettings(ort_threads=1)
    idle = settings.solver.sequences.idle_timeout_s
    limit = idle + 15.0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        flow = load_flow(write_random_checkpoint(tmp / "ckpt.safetensors", FlowConfig.small(), seed=0))
        write_repository(tmp / "repo", flow, settings, vocoder=random_vocoder(VocoderConfig.small(), seed=0))
        server = TritonServer(tmp / "repo", log_file=tmp / "server.log").start()
        server.wait_ready()
        runs = []
        try:
            for k in range(args.runs):
                runs.append(one_run(server, k, limit))
                print(f"run {k + 1}/{args.runs}: {runs[-1]}", flush=True)
        finally:
            t0 = time.monotonic()
            code = server.stop()
            stop_s = time.monotonic() - t0
    killed = [r["killed_freed_s"] for r in runs]
    ok = sum(s <= limit for s in killed)
    lines = [
        "# Sequence lifecycle: a killed client's sequence is freed, and the server stops on SIGTERM",
        "",
        f"Made by `python -m s3flow_tools.measure.lifecycle` (issue 31) on "
        f"{', '.join(f'{k} {v}' for k, v in machine().items())}. "
        "A small token2wav repository on seeded "
        f"random weights, the cpu target's defaults (idle timeout {idle:.0f} s, Triton's grace 30 s), one server.",
        "",
        "Each run: two clients close their streams after 2 of 5 chunks (token2mel, token2wav) and are evicted; a "
        "client process is SIGKILLed with its 3rd chunk on the way (token2wav) and another streams an utterance "
        "right after. Seconds until the solver and the vocoder hold nothing (`s3flow_live_sequences`, "
        "`s3flow_vocoder_live_sequences`):",
        "",
        "| run | abandoned streams freed (s after the 2nd closed) | killed client freed (s after the kill) |",
        "| ---: | ---: | ---: |",
    ] + [f"| {i + 1} | {r['abandoned_freed_s']:.1f} | {r['killed_freed_s']:.1f} |" for i, r in enumerate(runs)] + [
        "",
        f"**Freed within idle + 15 s = {limit:.0f} s: {ok} of {len(runs)} runs** (target: every run; before the fix, "
        f"3 of 10 such kills stayed live for good); slowest {max(killed):.1f} s.",
        "",
        f"Then `TritonServer.stop()`: **{stop_s:.1f} s, exit code {code}** (before the fix a server that had seen an "
        f"abandoned stream waited Triton's 30 s exit timeout and was killed).",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if ok == len(runs) and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
