#!/usr/bin/env python3
"""Bounded load test of the served ``token2mel`` model on loopback, plus a memory soak of the solver.

Phase 1 (load): ``--streams`` client threads, each streaming ``--utterances`` utterances one after the other
(seeded stand-in tokens, growing chunks), all at once against one server. Every chunk's frames are
checked as they arrive: offsets continue without gap or duplicate, each chunk brings exactly the frames
its tokens made final (2 per token, less the 6 look-ahead frames until END), and the END completes the
utterance with 2 frames per token. Then ``--check-outputs`` of the utterances are streamed again alone
and must match what they gave under load (batched with others) within 5e-4. Reported: chunk latency
p50/p99 (first chunks apart), errors, throughput, the cfm_solver stub's resident memory before/after.

Phase 2 (memory): ``--memory-utterances`` short utterances in a row (0.3 s, 2 chunks, 1 Euler step),
the solver stub's RSS sampled as they go; the growth from the post-warm-up start must stay within
``--rss-bound-mb``.

It builds a small seeded model repository into a temporary folder and starts tritonserver on 127.0.0.1
(or takes ``--repository``, or ``--url`` of a running server), writes a markdown report (default
``results/load_test.md``) and exits non-zero on any lost, misordered or miscounted frame, any error, an
output mismatch, a time-limit overrun or RSS growth beyond the bound.

Examples (from the repository root)::

    # the full run: 16 streams x 20 utterances, then 1,000 utterances in a row for memory
    .venv/bin/python scripts/load_test.py

    # a short run without the memory phase, report elsewhere
    .venv/bin/python scripts/load_test.py --streams 4 --utterances 3 --memory-utterances 0 --output /tmp/load.md

    # against a running server (RSS needs the server's PID, metrics its metrics port)
    .venv/bin/python scripts/load_test.py --url 127.0.0.1:8001 --server-pid 12345 --metrics-url 127.0.0.1:8002
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backend"))  # fallbacks when the packages are not installed
sys.path.insert(0, str(ROOT / "client"))

from s3flow_client import StreamError, StreamingClient, chunk_schedule  # noqa: E402
from s3flow_client.demo import demo_utterance  # noqa: E402
from s3flow.serving.metrics import HISTOGRAMS, histogram, metric_sum, read_metrics  # noqa: E402,F401 (re-exported)

LOOKAHEAD_FRAMES = 6     # 3 pre-lookahead tokens x 2 frames: withheld until the next chunk or END
FRAMES_PER_TOKEN = 2
OUTPUT_ATOL = 5e-4       # batched under load vs alone (padding changes float summation order)


# ------------------------------------------------------------------------------------------ server side
def build_small_repository(out: Path, *, streams: int = 16, seed: int = 0, idle_timeout_s: float = 60.0) -> Path:
    """A cpu repository of the small config on seeded random weights, limits sized for ``streams``."""
    from s3flow.model.checkpoint import load_flow, write_random_checkpoint
    from s3flow.model.flow import FlowConfig
    from s3flow.protocol import Limits
    from s3flow.serving.repository import Batching, RepositorySettings, write_repository

    out.mkdir(parents=True, exist_ok=True)
    ckpt = write_random_checkpoint(out / "ckpt.safetensors", FlowConfig.small(), seed=seed)
    limits = Limits(max_steps=20, max_live_sequences=max(4 * streams, 8), idle_timeout_s=idle_timeout_s)
    settings = RepositorySettings(limits=limits, batching=Batching(max_batch_size=8, max_queue_delay_us=2000),
                                  ort_threads=1)
    write_repository(out / "repo", load_flow(ckpt), settings)
    return out / "repo"


def solver_stub_pid(server_pid: int, model: str = "cfm_solver") -> Optional[int]:
    """PID of the python-backend stub serving ``model`` (a child of the server; its argv names model.py)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != server_pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if len(argv) > 1 and argv[1].decode(errors="replace").endswith(f"/{model}/1/model.py"):
            return int(entry)
    return None


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# read_metrics, metric_sum, histogram: s3flow.serving.metrics (prometheus_client's parser)


# ------------------------------------------------------------------------------------------ utterances
def load_utterance(index: int, steps: int):
    """Utterance ``index`` of the load: 0.8-2.4 s of tokens, a 0.4-1.0 s prompt, growing chunks."""
    rng = np.random.default_rng(index)
    u = demo_utterance(float(rng.uniform(0.8, 2.4)), seed=1000 + index, noise_seed=index,
                       prompt_seconds=float(rng.uniform(0.4, 1.0)))
    u.chunks = chunk_schedule(len(u.speech_tokens), 6, 2.0, 24)
    u.n_timesteps = steps
    return u


def memory_utterance(index: int, steps: int):
    """A 0.3 s utterance (8 tokens, chunks 4 + 4) with a 0.4 s prompt."""
    u = demo_utterance(0.3, seed=index % 50, noise_seed=index, prompt_seconds=0.4)
    u.chunks, u.n_timesteps = [4, 4], steps
    return u


def check_chunks(u, result, holdback_frames: int = 0) -> Optional[str]:
    """Exact per-chunk frame accounting of one streamed utterance; None if right, else what is wrong.

    (Order and continuity of frame offsets are checked by the client as responses arrive.)
    """
    if len(result.chunk_frames) != len(u.chunks):
        return f"{len(result.chunk_frames)} responses for {len(u.chunks)} chunks"
    tokens = frames = made = 0
    for k, (size, got) in enumerate(zip(u.chunks, result.chunk_frames)):
        tokens += size
        final = k == len(u.chunks) - 1
        made = FRAMES_PER_TOKEN * tokens if final else max(
            FRAMES_PER_TOKEN * tokens - LOOKAHEAD_FRAMES - holdback_frames, made)
        if frames + got != made:
            return f"chunk {k}: {got} frames after {frames}, expected {made - frames} ({tokens} tokens so far)"
        frames += got
    if result.mel.shape[1] != FRAMES_PER_TOKEN * len(u.speech_tokens):
        return f"{result.mel.shape[1]} frames for {len(u.speech_tokens)} tokens"
    if not np.isfinite(result.mel).all():
        return "non-finite mel values"
    return None


# ------------------------------------------------------------------------------------------ phase 1: load
@dataclass
class LoadReport:
    streams: int
    utterances: int
    steps: int
    wall_s: float = 0.0
    done: int = 0
    not_run: int = 0
    errors: list = field(default_factory=list)
    frame_errors: list = field(default_factory=list)
    output_mismatches: list = field(default_factory=list)
    chunk_latencies: list = field(default_factory=list)   # later chunks, seconds
    first_latencies: list = field(default_factory=list)   # first chunk of each utterance
    chunks: int = 0
    audio_s: float = 0.0
    rss_before_mb: Optional[float] = None
    rss_after_mb: Optional[float] = None
    live_after: Optional[float] = None
    #: the solver's histograms over the load phase (s3flow.serving.metrics.HISTOGRAMS): {name: Histogram of the deltas}
    server_histograms: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.errors or self.frame_errors or self.output_mismatches or self.not_run)

    def percentile_ms(self, which: str, q: float) -> float:
        values = getattr(self, which)
        return 1000 * float(np.percentile(values, q)) if values else float("nan")


def run_load(url: str, streams: int, utterances: int, steps: int = 2, time_limit_s: float = 600.0,
             check_outputs: int = 2, stub_pid: Optional[int] = None, metrics_url: Optional[str] = None,
             holdback_frames: int = 0, log=print) -> LoadReport:
    """``streams`` threads x ``utterances`` utterances each; see the module docstring."""
    report = LoadReport(streams, utterances, steps)
    report.rss_before_mb = rss_mb(stub_pid) if stub_pid else None
    results: dict[int, object] = {}
    lock = threading.Lock()
    before = read_metrics(metrics_url) if metrics_url else None
    start = time.monotonic()
    deadline = start + time_limit_s

    def worker(w: int):
        for j in range(utterances):
            index = w * utterances + j
            left = deadline - time.monotonic()
            if left <= 1.0:
                with lock:
                    report.not_run += utterances - j
                return
            u = load_utterance(index, steps)
            client = StreamingClient(url, timeout_s=left, response_timeout_s=min(left, 60.0))
            try:
                [r] = client.synthesize([u])
            except Exception as exc:  # noqa: BLE001 -- counted, never lost: a load test reports every failure
                with lock:
                    report.errors.append(f"utterance {index}: {exc if isinstance(exc, StreamError) else repr(exc)}")
                continue
            bad = check_chunks(u, r, holdback_frames)
            with lock:
                results[index] = r
                report.done += 1
                report.chunks += len(r.chunk_frames)
                report.audio_s += r.audio_s
                report.first_latencies.append(r.chunk_latencies_s[0])
                report.chunk_latencies.extend(r.chunk_latencies_s[1:])
                if bad:
                    report.frame_errors.append(f"utterance {index}: {bad}")

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0) + 30)
    report.wall_s = time.monotonic() - start
    if any(t.is_alive() for t in threads):
        report.errors.append(f"client threads still running {report.wall_s:.0f} s after the start")
    log(f"load: {report.done} utterances, {report.chunks} chunks in {report.wall_s:.1f} s; "
        f"{len(report.errors)} errors, {len(report.frame_errors)} frame-accounting errors")
    if before is not None:
        report.errors += server_histograms(report, before, read_metrics(metrics_url))

    # the same utterances alone must give what they gave batched under load
    for index in sorted(results)[:check_outputs]:
        u = load_utterance(index, steps)
        try:
            [alone] = StreamingClient(url, timeout_s=120).synthesize([u])
        except StreamError as exc:
            report.errors.append(f"utterance {index} alone: {exc}")
            continue
        err = float(np.abs(alone.mel - results[index].mel).max())
        if not err <= OUTPUT_ATOL:
            report.output_mismatches.append(f"utterance {index}: under load vs alone differ by {err:.2e}")
    report.rss_after_mb = rss_mb(stub_pid) if stub_pid else None
    if metrics_url:
        report.live_after = live_sequences(metrics_url)
    return report


def server_histograms(report: LoadReport, before: dict, after: dict) -> list[str]:
    """Fill ``report.server_histograms`` with what the load phase added to the solver's histograms; return
    what disagrees with the client's own counts (every answered chunk observed once, a first chunk per
    utterance). Only exact when this load is the server's only traffic and nothing failed."""
    problems = []
    for family in HISTOGRAMS:
        h0, h1 = histogram(before, family.name), histogram(after, family.name)
        h1.buckets = {le: v - h0.buckets.get(le, 0.0) for le, v in h1.buckets.items()}
        h1.sum, h1.count = h1.sum - h0.sum, h1.count - h0.count
        report.server_histograms[family.name] = h1
        if not h1.buckets:
            problems.append(f"/metrics has no histogram {family.name}")
    if report.errors or report.not_run:
        return problems
    for name, want in (("s3flow_chunk_seconds", report.chunks), ("s3flow_first_chunk_seconds", report.done)):
        got = report.server_histograms[name].count
        if got != want:
            problems.append(f"{name}_count grew by {got:g} over the load, the client got {want} answers")
    return problems


def live_sequences(metrics_url: str, settle_s: float = 5.0) -> float:
    """The solver's live-sequence gauge, after waiting up to ``settle_s`` for it to reach 0."""
    end = time.monotonic() + settle_s
    while True:
        live = metric_sum(read_metrics(metrics_url), "s3flow_live_sequences")
        if live == 0 or time.monotonic() > end:
            return live
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------ phase 2: memory
@dataclass
class MemoryReport:
    utterances: int
    warmup: int
    steps: int
    samples: list = field(default_factory=list)   # (utterances done, RSS MiB)
    wall_s: float = 0.0
    errors: list = field(default_factory=list)
    live_after: Optional[float] = None

    @property
    def start_mb(self) -> float:
        return self.samples[0][1]

    @property
    def end_mb(self) -> float:
        return self.samples[-1][1]

    @property
    def growth_mb(self) -> float:
        return self.end_mb - self.start_mb

    @property
    def peak_growth_mb(self) -> float:
        return max(s[1] for s in self.samples) - self.start_mb


def run_memory(url: str, stub_pid: int, utterances: int, steps: int = 1, warmup: int = 50,
               samples: int = 10, metrics_url: Optional[str] = None, log=print) -> MemoryReport:
    """``warmup`` utterances, then RSS; then ``utterances`` in a row, RSS sampled ``samples`` times."""
    report = MemoryReport(utterances, warmup, steps)
    client = StreamingClient(url, timeout_s=60, response_timeout_s=30)
    every = max(utterances // max(samples, 1), 1)
    start = time.monotonic()
    for i in range(-warmup, utterances):
        if i == 0:
            report.samples.append((0, rss_mb(stub_pid)))
            start = time.monotonic()
        u = memory_utterance(i + warmup, steps)
        try:
            [r] = client.synthesize([u])
            bad = check_chunks(u, r)
            if bad:
                report.errors.append(f"utterance {i}: {bad}")
        except StreamError as exc:
            report.errors.append(f"utterance {i}: {exc}")
        if i >= 0 and (i + 1) % every == 0:
            report.samples.append((i + 1, rss_mb(stub_pid)))
    report.wall_s = time.monotonic() - start
    if metrics_url:
        report.live_after = live_sequences(metrics_url)
    log(f"memory: {utterances} utterances in {report.wall_s:.1f} s; solver RSS {report.start_mb:.2f} -> "
        f"{report.end_mb:.2f} MiB (peak growth {report.peak_growth_mb:+.2f} MiB); {len(report.errors)} errors")
    return report


# ------------------------------------------------------------------------------------------ report
def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu}, {os.cpu_count()} logical cores, Python {platform.python_version()}; load average "
            f"(1, 5, 15 min) at the end: {load} (other processes share this host)")


def markdown(load: Optional[LoadReport], memory: Optional[MemoryReport], command: str, setup: str,
             rss_bound_mb: float) -> str:
    fmt = lambda v, unit="": "n/a" if v is None else f"{v:.1f}{unit}"  # noqa: E731
    lines = ["# Load and memory test", "", f"Command: `{command}`", "", f"Machine: {machine()}.", "",
             f"Set-up: {setup}", ""]
    if load is not None:
        n = load.done
        lines += [
            f"## Load: {load.streams} concurrent streams x {load.utterances} utterances, {load.steps} Euler steps",
            "",
            "| figure | value |", "| --- | --- |",
            f"| utterances completed / not run (time limit) | {n} / {load.not_run} |",
            f"| chunks | {load.chunks} |",
            f"| errors | {len(load.errors)} |",
            f"| lost, misordered or miscounted frames (utterances) | {len(load.frame_errors)} |",
            f"| outputs under load vs alone, max abs diff > {OUTPUT_ATOL} | {len(load.output_mismatches)} |",
            f"| chunk latency p50 / p99 (chunks after the first) | {load.percentile_ms('chunk_latencies', 50):.0f} / "
            f"{load.percentile_ms('chunk_latencies', 99):.0f} ms |",
            f"| first-chunk latency p50 / p99 | {load.percentile_ms('first_latencies', 50):.0f} / "
            f"{load.percentile_ms('first_latencies', 99):.0f} ms |",
            f"| wall time | {load.wall_s:.1f} s |",
            f"| throughput | {n / load.wall_s:.2f} utterances/s, {load.chunks / load.wall_s:.1f} chunks/s, "
            f"{load.audio_s / load.wall_s:.2f} s of audio per s |",
            f"| cfm_solver stub RSS before / after | {fmt(load.rss_before_mb, ' MiB')} / "
            f"{fmt(load.rss_after_mb, ' MiB')} |",
            f"| live sequences after | {fmt(load.live_after)} |", ""]
        if load.server_histograms:
            lines += ["The solver's histograms over the load (`/metrics`, docs/operations.md): observations, mean, "
                      "and the p50 / p99 bucket bounds (`histogram_quantile`'s upper bounds):", "",
                      "| histogram | count | mean | p50 <= | p99 <= |", "| --- | ---: | ---: | ---: | ---: |"]
            for name, h in load.server_histograms.items():
                mean = h.sum / h.count if h.count else float("nan")
                lines.append(f"| `{name}` | {h.count:g} | {mean:.3g} | {h.quantile(0.5)} | {h.quantile(0.99)} |")
            lines.append("")
        for title, items in (("Errors", load.errors), ("Frame errors", load.frame_errors),
                             ("Output mismatches", load.output_mismatches)):
            if items:
                lines += [f"{title} (first 10):", ""] + [f"- {e}" for e in items[:10]] + [""]
    if memory is not None:
        lines += [
            f"## Memory: {memory.utterances} utterances of 0.3 s in a row ({memory.steps} Euler step, chunks 4 + 4)",
            "", f"After {memory.warmup} warm-up utterances, the cfm_solver stub's RSS every "
            f"{memory.samples[1][0] if len(memory.samples) > 1 else memory.utterances} utterances:", "",
            "| utterances | RSS (MiB) | growth (MiB) |", "| --- | --- | --- |"]
        lines += [f"| {k} | {mb:.2f} | {mb - memory.start_mb:+.2f} |" for k, mb in memory.samples]
        verdict = "within" if memory.growth_mb <= rss_bound_mb else "ABOVE"
        lines += ["", f"Growth {memory.growth_mb:+.2f} MiB (peak {memory.peak_growth_mb:+.2f} MiB), {verdict} the "
                  f"bound of {rss_bound_mb:g} MiB; {len(memory.errors)} errors; live sequences after: "
                  f"{fmt(memory.live_after)}; {memory.utterances / memory.wall_s:.1f} utterances/s.", ""]
        if memory.errors:
            lines += [f"- {e}" for e in memory.errors[:10]] + [""]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server (default: build a small repository in a temp folder and start one)")
    s.add_argument("--repository", type=Path, help="serve this model repository instead")
    s.add_argument("--url", help="use this running server (host:port of gRPC) instead")
    s.add_argument("--server-pid", type=int, help="with --url: the server's PID, to measure the solver's RSS")
    s.add_argument("--metrics-url", help="with --url: host:port of the server's metrics endpoint")
    s.add_argument("--holdback-frames", type=int, default=0, help="the server's holdback_frames (default: 0)")
    g = p.add_argument_group("load")
    g.add_argument("--streams", type=int, default=16, help="concurrent client streams (default: 16)")
    g.add_argument("--utterances", type=int, default=20, help="utterances per stream (default: 20)")
    g.add_argument("--steps", type=int, default=2, help="Euler steps per utterance (default: 2)")
    g.add_argument("--time-limit", type=float, default=600.0, help="seconds for the load phase (default: 600)")
    g.add_argument("--check-outputs", type=int, default=2,
                   help="utterances streamed again alone and compared (default: 2)")
    m = p.add_argument_group("memory")
    m.add_argument("--memory-utterances", type=int, default=1000, help="0 skips the phase (default: 1000)")
    m.add_argument("--memory-steps", type=int, default=1, help="(default: 1)")
    m.add_argument("--rss-bound-mb", type=float, default=8.0,
                   help="allowed solver RSS growth over the phase (default: 8; keeping every 0.3 s "
                        "utterance's state, about 17 KB, would add about 17 MiB over 1,000)")
    p.add_argument("--output", type=Path, default=ROOT / "results" / "load_test.md",
                   help="markdown report (default: results/load_test.md)")
    args = p.parse_args(argv)
    if args.url and args.repository:
        p.error("give --url or --repository, not both")
    if min(args.streams, args.utterances, args.steps) < 1:
        p.error("--streams, --utterances and --steps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = " ".join([".venv/bin/python scripts/load_test.py"] + (sys.argv[1:] if argv is None else argv))
    with tempfile.TemporaryDirectory(prefix="s3flow-load-") as tmp:
        server = None
        if args.url:
            url, pid, metrics_url = args.url, args.server_pid, args.metrics_url
            setup = f"running server at {url}."
        else:
            from s3flow.serving.triton_server import TritonServer

            repo = args.repository or build_small_repository(Path(tmp), streams=args.streams)
            what = f"the repository {repo}" if args.repository else \
                "a small seeded repository (FlowConfig.small, built in a temporary folder)"
            setup = (f"tritonserver on 127.0.0.1 over {what}; cpu target, python backend + ONNX Runtime "
                     f"(1 thread per model), oldest sequence batching (max batch 8, 2 ms queue delay). The RSS "
                     f"step during the load phase is first-use allocation (longer, batched prefixes); the "
                     f"memory phase starts after it.")
            server = TritonServer(repo, log_file=Path(tmp) / "server.log")
            server.__enter__()
            url, pid, metrics_url = server.grpc_url, server.pid, f"127.0.0.1:{server.metrics_port}"
        try:
            stub = solver_stub_pid(pid) if pid else None
            if pid and stub is None:
                print(f"warning: no cfm_solver stub found among the children of pid {pid}", file=sys.stderr)
            load = run_load(url, args.streams, args.utterances, args.steps, args.time_limit, args.check_outputs,
                            stub, metrics_url, args.holdback_frames)
            memory = None
            if args.memory_utterances and stub:
                memory = run_memory(url, stub, args.memory_utterances, args.memory_steps, metrics_url=metrics_url)
            elif args.memory_utterances:
                print("memory phase skipped: the solver stub's PID is unknown (give --server-pid)", file=sys.stderr)
        finally:
            if server is not None:
                server.__exit__(None, None, None)
    text = markdown(load, memory, command, setup, args.rss_bound_mb)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    failed = not load.ok or (memory is not None and (memory.errors or memory.growth_mb > args.rss_bound_mb))
    failed = failed or bool(load.live_after) or bool(memory and memory.live_after)
    print(f"\n{'FAILED' if failed else 'passed'}; report written to {args.output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
