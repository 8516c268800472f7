#!/usr/bin/env python3
"""Bounded load test of the served ``token2mel`` model on loopback, plus a memory soak of the solver.

Phase 1 (load): ``--streams`` client threads, each streaming ``--utterances`` utterances one after the other
(seeded stand-in tokens, growing chunks), all at once against one server. Every chunk's frames are
checked as they arrive: offsets continue without gap or duplicate, each chunk brings exactly the frames
its tokens made final (2 per token, less the 6 look-ahead frames until END), and the END completes the
utterance with 2 frames per token. Then ``--check-outputs`` of the utterances are streamed again alone
and must match what they gave under load (batched with others) within 5e-4. Reported: chunk latency
p50/p99 (first chunks apart), errors, throughput, the cfm_solver stub's resident memory before/after.

Phase 2 (memory): ``--memory-utterances`` short utterances in a row (0.3 s, 2 chunks, 1 Euler step) through
``--memory-model`` (token2wav: the vocoder's stub watched too), the stubs' RSS sampled as they go; the growth from
the post-warm-up start (by the samples' least-squares line, ``MemoryReport.growth``) must stay within
``--rss-bound-mb``. ``--scheduling deadline`` builds the repository with
the step-level scheduler.

It builds a small seeded model repository into a temporary folder and starts tritonserver on 127.0.0.1
(or takes ``--repository``, or ``--url`` of a running server), writes a markdown report (default
``results/load_test.md``) and exits non-zero on any lost, misordered or miscounted frame, any error, an
output mismatch, a time-limit overrun or RSS growth beyond the bound. The phases and the frame accounting
are ``s3flow_tools.bench.load``; this script finds or starts the server and writes the report.

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
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

from s3flow_tools.bench.load import (OUTPUT_ATOL, LoadReport, MemoryReport, run_load, run_memory,
                                      solver_stub_pid)


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
            f"| first-chunk latency p50 / p99 (first audio, token2mel) | {load.percentile_ms('first_latencies', 50):.0f} / "
            f"{load.percentile_ms('first_latencies', 99):.0f} ms |",
            f"| utterances whose real-time player ran dry (start at first audio / 0.3 s buffer) | "
            f"{100 * load.stalled('stall_s'):.0f} % / {100 * load.stalled('stall_s_buffered'):.0f} % |",
            f"| stall seconds per utterance p50 / p95 (no buffer) | {load.percentile_ms('stall_s', 50) / 1000:.2f} / "
            f"{load.percentile_ms('stall_s', 95) / 1000:.2f} s |",
            f"| admission: utterances refused (busy) before they were admitted, busy answers, time to admission "
            f"p50 / max | {load.refused} of {n}, {load.busy_answers}, {load.percentile_ms('admission_s', 50) / 1000:.2f} / "
            f"{max(load.admission_s, default=0.0):.2f} s |",
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
        stubs = memory.stubs
        lines += [
            f"## Memory: {memory.utterances} utterances of 0.3 s in a row through `{memory.model}` "
            f"({memory.steps} Euler step, chunks 4 + 4)",
            "", f"After {memory.warmup} warm-up utterances, the stubs' RSS every "
            f"{memory.samples[1][0] if len(memory.samples) > 1 else memory.utterances} utterances (MiB, growth):", "",
            "| utterances | " + " | ".join(f"`{s}`" for s in stubs) + " |", "| --- |" + " --- |" * len(stubs)]
        lines += [f"| {k} | " + " | ".join(f"{mb[s]:.2f} ({mb[s] - memory.start_mb(s):+.2f})" for s in stubs) + " |"
                  for k, mb in memory.samples]
        verdict = "within" if memory.growth_mb <= rss_bound_mb else "ABOVE"
        growth = ", ".join(f"{s} {memory.growth(s):+.2f} MiB (peak {memory.peak_growth(s):+.2f})" for s in stubs)
        lines += ["", f"Growth {growth}: {verdict} the bound of {rss_bound_mb:g} MiB; {len(memory.errors)} errors; "
                  f"live sequences after: {fmt(memory.live_after)}; {memory.utterances / memory.wall_s:.1f} "
                  f"utterances/s.", ""]
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
    s.add_argument("--scheduling", choices=("fifo", "deadline"), default="fifo",
                   help="the built repository's scheduling (default: fifo)")
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
    m.add_argument("--memory-model", choices=("token2mel", "token2wav"), default="token2mel",
                   help="the ensemble the memory phase streams through; token2wav watches the vocoder's stub too "
                        "(default: token2mel)")
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
            from s3flow.server.triton_server import TritonServer
            from s3flow_tools.bench.repos import load_test_repository

            repo = args.repository or load_test_repository(Path(tmp), streams=args.streams, scheduling=args.scheduling,
                                                           vocoder=args.memory_model == "token2wav")
            what = f"the repository {repo}" if args.repository else \
                f"a small seeded repository (FlowConfig.small, built in a temporary folder; {args.scheduling} scheduling)"
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
                stubs = {"cfm_solver": stub}
                if args.memory_model == "token2wav":
                    stubs["vocoder"] = solver_stub_pid(pid, "vocoder")
                memory = run_memory(url, stubs, args.memory_utterances, args.memory_steps, metrics_url=metrics_url,
                                    model=args.memory_model)
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
