#!/usr/bin/env python3
"""Speed of the token-to-mel flow, side by side in one run on the same weights and inputs.

Three paths over the full-size model (seeded random weights, or ``--checkpoint``):

  (a) eager reference: the package's torch modules and solver in process (``s3flow.model.flow.synthesize``);
  (b) ONNX Runtime in process: the same streaming engine and solver, encoder and estimator in ONNX Runtime
      (``s3flow.runtime.ort``), on the very ONNX files the server loads;
  (c) served: the repository in a real tritonserver, streamed over gRPC by ``StreamingClient``.

For regular 10-step guided synthesis and meanflow 2 steps, and for utterances of about 2, 5 and 10 s, it
reports offline latency, streaming first-chunk latency, real-time factor, network evaluations (NFE), the
estimator's achieved GFLOP/s (FLOPs counted by ``s3flow.model.flops``) against this machine's fp32 GEMM rate
measured in the same run, and the share of served time outside the estimator (from Triton's statistics:
the estimator model's ``compute_infer`` time). Then cross-utterance batching: throughput and p50/p99 chunk
latency at 1, 2, 4 and 8 concurrent streams against the same utterances streamed one at a time.

It prints one table of ratios against the targets and writes it, with the machine, the settings and the
detail tables, to ``results/benchmark.md``. It checks its own outputs (ONNX Runtime and served mel against
eager, served first chunk against in-process) and exits non-zero when one is off. The results and tables
are ``s3flow_tools.bench.report``, the served loads ``s3flow_tools.bench.served``.

Examples::

    # the full run: ~10-15 min on a quiet 2-core host (15 min at --threads 1 on a loaded one); the 10 s
    # utterance, 10 steps, streamed, alone takes about a minute
    .venv/bin/python scripts/benchmark.py

    # a short run, ~3 min: 2 and 5 s utterances, one repeat, batching measured on the small config
    .venv/bin/python scripts/benchmark.py --quick

    # only the regular model at 5 s, no batching section, results elsewhere
    .venv/bin/python scripts/benchmark.py --modes regular --seconds 5 --no-batching --out /tmp/bench.md

    # a real checkpoint (its mode, regular or meanflow, is detected); the other mode uses random weights
    .venv/bin/python scripts/benchmark.py --checkpoint ~/models/s3gen.safetensors

Timings on a shared host are noisy: every figure is the best of ``--repeats`` runs, and the ratios, measured
side by side in one run, are what to compare. The load average before and after is recorded. Where another
process holds a core, multi-threaded torch (OpenMP) slows down many times over (eager estimator 8.5 s
instead of 0.68 s, measured here), which flatters every ratio against eager: run with ``--threads 1`` there.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]

import numpy as np
import torch

from s3flow_contract.tensors import TOKENS_PER_SECOND
from s3flow.engine.planning import planned_calls
from s3flow.engine.streaming import StreamingEngine
from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import random_flow
from s3flow.model.flops import chunk_calls, estimator_flops, solve_flops
from s3flow.model.flow import FlowConfig, TorchEstimator, synthesize
from s3flow.engine.settings import SolverSettings
from s3flow.serving.local_stream import stream_in_process
from s3flow.serving.session import SolverSession
from s3flow.runtime.ort import OrtSettings
from s3flow.runtime.ort_engine import OrtEncoder, OrtEstimator
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient, Utterance, chunk_schedule
from s3flow_tools.bench.report import (MEL_ATOL, RATIO_HEADER, SCHEDULE, CaseResult, PathResult,
                                        Report, log, machine, markdown, ratio_table, write_report)
from s3flow_tools.bench.served import ServerStats, measure_batching
from s3flow_client.demo import demo_utterance


STEPS = {"regular": 10, "meanflow": 2}


# ---------------------------------------------------------------------------------------------------
# Measuring instruments


class TimedEstimator:
    """Wraps an estimator callable: records each call's (batch, frames) and the seconds spent in it."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.calls: list[tuple[int, int]] = []
        self.seconds = 0.0

    def reset(self) -> None:
        self.calls, self.seconds = [], 0.0

    def __call__(self, inputs):
        t0 = time.perf_counter()
        v = self.fn(inputs)
        self.seconds += time.perf_counter() - t0
        self.calls.append((int(inputs.x.shape[0]), int(inputs.x.shape[2])))
        return v


def gemm_rate(n: int = 2048, reps: int = 5) -> float:
    """fp32 GEMM rate of this machine (GFLOP/s): torch.matmul of n x n matrices, best of reps."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = min(_timed(lambda: torch.matmul(a, b)) for _ in range(reps))
    return 2 * n ** 3 / best / 1e9


def _timed(fn: Callable) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------
# The in-process engine


def engine_chunk(engine: StreamingEngine, u: Utterance, n_tokens: int, final: bool, corr_id: int = 1):
    """Time the first chunk (n_tokens) of u through an in-process engine (``stream_in_process``); return
    (seconds, mel)."""
    session = SolverSession(engine)
    got = stream_in_process(session, u.speech_tokens, [n_tokens], corr_id=corr_id, end=final,
                            prompt_tokens=u.prompt_tokens, prompt_mel=u.prompt_mel,
                            speaker_embedding=u.speaker_embedding, seed=u.seed, n_timesteps=u.n_timesteps,
                            guidance_rate=u.guidance_rate)
    session.cancel(corr_id)
    return got.latencies_s[0], got.mel


# ---------------------------------------------------------------------------------------------------
# The measurements


def utterances(seconds: list[float], prompt_seconds: float) -> list[Utterance]:
    return [demo_utterance(s, seed=100 + k, noise_seed=k, prompt_seconds=prompt_seconds)
            for k, s in enumerate(seconds)]


MICRO_FRAMES = (300, 64)


def measure_estimator_alone(flow, repo: Path, args, report: Report) -> None:
    """One estimator forward at B = 2 (one guided utterance), T = 300 and 64 frames: eager, ONNX Runtime on
    the file as exported, and with the load-time CPU rewrite; interleaved, best of N."""
    from s3flow.model.solver import EstimatorInputs
    from s3flow.runtime.onnx_export import make_estimator_inputs

    path = repo / "estimator" / "1" / "model.onnx"
    fns = {"eager": TorchEstimator(flow.estimator),
           "ort_plain": OrtEstimator(path, OrtSettings(threads=args.threads, rewrite=False)),
           "ort": OrtEstimator(path, OrtSettings(threads=args.threads))}
    reps = max(args.repeats, 2) + 1
    for frames in MICRO_FRAMES:
        inputs = EstimatorInputs(**make_estimator_inputs(flow.estimator, 2, frames, lengths=[frames, frames]))
        for fn in fns.values():
            fn(inputs)
        times = {k: [] for k in fns}
        for _ in range(reps if frames >= 300 else 3 * reps):   # interleaved: all see the same machine
            for name, fn in fns.items():
                times[name].append(_timed(lambda: fn(inputs)))
        report.micro[frames] = {k: min(v) for k, v in times.items()}
        report.micro_flops[frames] = estimator_flops(flow.config.estimator, 2, frames).total
        log(f"estimator alone, B=2 T={frames}: " + ", ".join(f"{k} {v:.3f} s" for k, v in report.micro[frames].items()))


def measure_mode(mode: str, flow, repo: Path, args, report: Report, batching_here: bool) -> None:
    steps = STEPS[mode]
    meanflow = flow.config.meanflow
    cfg = flow.config.estimator
    threads = args.threads
    solver = SolverSettings()
    ort_settings = OrtSettings(threads=threads)

    eager_est = TimedEstimator(TorchEstimator(flow.estimator))

    def encode_torch(tokens, token_len, embedding):
        with torch.inference_mode():
            return flow.encoder(tokens, token_len, embedding)

    eager_engine = StreamingEngine(encode_torch, eager_est, n_feats=flow.config.n_feats, meanflow=meanflow,
                                   solving=solver.solving)
    ort_est = TimedEstimator(OrtEstimator(repo / "estimator" / "1" / "model.onnx", ort_settings))
    ort_enc = OrtEncoder(repo / "flow_encoder" / "1" / "model.onnx", OrtSettings(threads=threads))
    ort_engine = StreamingEngine(ort_enc, ort_est, n_feats=flow.config.n_feats, meanflow=meanflow,
                                 solving=solver.solving)

    if mode == "regular" and not args.no_micro:
        measure_estimator_alone(flow, repo, args, report)

    utts = utterances(args.seconds, args.prompt_seconds)
    for u in utts:
        u.n_timesteps = steps
    log(f"{mode}: starting tritonserver on {repo}")
    with TritonServer(repo, log_file=repo.parent / f"server_{mode}.log") as server:
        client = StreamingClient(server.grpc_url, timeout_s=3600)
        client.synthesize([_copy(utts[0], chunks=[len(utts[0].speech_tokens)])])   # warm-up: loads, allocates
        for u, seconds in zip(utts, args.seconds):
            n = len(u.speech_tokens)
            frames = 2 * (len(u.prompt_tokens) + n)
            case = CaseResult(mode=mode, seconds=seconds, audio_s=n / TOKENS_PER_SECOND, frames=frames)
            sched = chunk_schedule(n, *SCHEDULE)
            log(f"{mode} {seconds:g} s ({n} tokens, T = {frames}): eager / ONNX Runtime / served, "
                f"best of {args.repeats}")
            eager, ort_r, served = PathResult(), PathResult(), PathResult()
            ref_mel = ort_mel = first_ort = None
            for rep in range(args.repeats):
                # (a) eager offline
                eager_est.reset()
                t0 = time.perf_counter()
                out = synthesize(flow, torch.from_numpy(u.speech_tokens)[None], torch.from_numpy(u.prompt_tokens)[None],
                                 torch.from_numpy(u.prompt_mel)[None], torch.from_numpy(u.speaker_embedding)[None],
                                 seed=u.seed, n_steps=steps, estimator=eager_est)
                dt = time.perf_counter() - t0
                if dt < eager.offline_s or rep == 0:
                    eager.offline_s, eager.estimator_s = dt, eager_est.seconds
                    eager.flops, eager.nfe_offline = solve_flops(cfg, eager_est.calls), out.nfe
                ref_mel = out.mel[0].numpy()
                # (b) ONNX Runtime offline: the engine with one chunk
                ort_est.reset()
                dt, ort_mel = engine_chunk(ort_engine, u, n, final=True)
                if dt < ort_r.offline_s or rep == 0:
                    ort_r.offline_s, ort_r.estimator_s = dt, ort_est.seconds
                    ort_r.flops, ort_r.nfe_offline = solve_flops(cfg, ort_est.calls), len(ort_est.calls)
                # (a), (b) first chunk of the stream
                dt, _ = engine_chunk(eager_engine, u, sched[0], final=len(sched) == 1)
                eager.first_chunk_s = min(eager.first_chunk_s, dt) if rep else dt
                dt, first_ort = engine_chunk(ort_engine, u, sched[0], final=len(sched) == 1)
                ort_r.first_chunk_s = min(ort_r.first_chunk_s, dt) if rep else dt
                # (c) served offline: one request with every token
                stats = ServerStats(server)
                [res] = client.synthesize([_copy(u, chunks=[n])])
                d = stats.delta()
                if res.wall_s < served.offline_s or rep == 0:
                    served.offline_s, served.estimator_s, served.encoder_s = res.wall_s, d["estimator"][0], \
                        d["flow_encoder"][0]
                    served.nfe_offline = d["estimator"][1]
                    served.flops = solve_flops(cfg, chunk_calls(cfg, len(u.prompt_tokens), [n], steps, True))
                served_mel = res.mel
            # (c) served stream (once: the slow one)
            stats = ServerStats(server)
            [res] = client.synthesize([_copy(u, chunks=sched)])
            d = stats.delta()
            served.first_chunk_s, served.stream_wall_s = res.first_chunk_s, res.wall_s
            served.nfe_stream = d["estimator"][1]
            served.stream_estimator_s = d["estimator"][0]
            served.stream_flops = solve_flops(cfg, planned_calls(cfg.out_channels, len(u.prompt_tokens), sched,
                                                                 solver.solving.context_frames, steps, meanflow=meanflow))
            eager.nfe_stream = ort_r.nfe_stream = served.nfe_stream
            case.paths = {"eager": eager, "ort": ort_r, "served": served}
            case.checks = {"ort vs eager (offline mel)": float(np.abs(ort_mel - ref_mel).max()),
                           "served vs eager (offline mel)": float(np.abs(served_mel - ref_mel).max()),
                           "served vs ort (first chunk)": float(np.abs(res.mel[:, :first_ort.shape[1]]
                                                                       - first_ort).max())}
            for name, err in case.checks.items():
                if not err <= MEL_ATOL:
                    report.failures.append(f"{mode} {seconds:g} s: {name} differs by {err:.2e} > {MEL_ATOL}")
            report.cases.append(case)
            log(f"  offline: eager {eager.offline_s:.2f} s, ort {ort_r.offline_s:.2f} s, served "
                f"{served.offline_s:.2f} s; served stream: first chunk {served.first_chunk_s:.2f} s, wall "
                f"{served.stream_wall_s:.2f} s; checks {', '.join(f'{v:.1e}' for v in case.checks.values())}")
        if batching_here:
            measure_batching(server, flow.config.n_feats, args, report, steps=steps)


def _copy(u: Utterance, **changes) -> Utterance:
    return dataclasses.replace(u, **changes)


# ---------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="short run (~3 min): 2 and 5 s, one repeat, batching on the small config")
    w = p.add_argument_group("what to run")
    w.add_argument("--modes", nargs="+", choices=list(STEPS), default=list(STEPS), help="(default: both)")
    w.add_argument("--seconds", type=float, nargs="+", help="utterance lengths (default: 2 5 10; quick: 2 5)")
    w.add_argument("--prompt-seconds", type=float, default=1.0, help="speaker prompt length (default: %(default)s)")
    w.add_argument("--repeats", type=int, help="best of this many (default: 3; quick: 1)")
    w.add_argument("--no-micro", action="store_true", help="skip the estimator-alone figures (B=2, T=300 and 64)")
    b = p.add_argument_group("batching across utterances")
    b.add_argument("--no-batching", action="store_true", help="skip the batching section")
    b.add_argument("--batching-size", choices=["full", "small"], help="model for it (default: full; quick: small)")
    b.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8], help="(default: %(default)s)")
    b.add_argument("--batch-seconds", type=float, default=2.0, help="utterance length (default: %(default)s)")
    b.add_argument("--max-queue-delay-us", type=int, default=Batching().max_queue_delay_us,
                   help="solver queue delay of the served repository (default: %(default)s)")
    m = p.add_argument_group("weights, repository, machine")
    m.add_argument("--checkpoint", type=Path, help="an S3Gen checkpoint for its mode (default: seeded random)")
    m.add_argument("--repository", type=Path, help="a repository built from --checkpoint (default: build one)")
    m.add_argument("--size", choices=["full", "small"], default="full",
                   help="model size of the main sections; small is a smoke test of the script (default: full)")
    m.add_argument("--seed", type=int, default=0, help="random weights' seed (default: %(default)s)")
    m.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch and ONNX Runtime threads (default: all cores, %(default)s)")
    m.add_argument("--workdir", type=Path, help="where repositories and logs go (default: a temporary folder)")
    m.add_argument("--out", type=Path, default=ROOT / "results" / "benchmark.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    args.seconds = args.seconds or ([2.0, 5.0] if args.quick else [2.0, 5.0, 10.0])
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.batching_size = args.batching_size or ("small" if args.quick else "full")
    if args.repository is not None and args.checkpoint is None:
        p.error("--repository needs the --checkpoint it was built from (the in-process paths load its weights)")
    args.batching = Batching(max_queue_delay_us=args.max_queue_delay_us)
    return args


def build_repo(flow, out: Path, threads: int, batching: Batching) -> Path:
    t0 = time.perf_counter()
    write_repository(out, flow, RepositorySettings(batching=batching, ort_threads=threads))
    log(f"wrote repository {out} ({time.perf_counter() - t0:.0f} s)")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM (a killed run) unwinds like Ctrl-C, so the servers' context managers stop them by PID
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="s3flow-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    report = Report(settings=dict(command="python scripts/benchmark.py " + " ".join(sys.argv[1:] if argv is None else argv),
                                  threads=args.threads, seed=args.seed, size=args.size, seconds=args.seconds,
                                  prompt_seconds=args.prompt_seconds, repeats=args.repeats,
                                  checkpoint=str(args.checkpoint) if args.checkpoint else "none",
                                  batch_seconds=args.batch_seconds,
                                  batching=f"strategy {args.batching.strategy}, max_batch_size "
                                           f"{args.batching.max_batch_size}, max_queue_delay_us "
                                           f"{args.batching.max_queue_delay_us}, 1 instance per model, "
                                           f"ONNX Runtime threads {args.threads}"),
                    machine=machine())
    report.load.append(os.getloadavg()[0])
    t_start = time.perf_counter()
    report.gemm.append(gemm_rate())
    log(f"GEMM rate {report.gemm[-1]:.0f} GFLOP/s ({args.threads} threads); working in {work}")

    given = load_flow(args.checkpoint) if args.checkpoint else None
    report.batching_size = ("small config (FlowConfig.small), regular 10 steps" if args.batching_size == "small"
                            else "full size, regular 10 steps")
    want_batching = not args.no_batching
    for mode in args.modes:
        meanflow = mode == "meanflow"
        if given is not None and given.config.meanflow == meanflow:
            flow, repo = given.eval(), args.repository
        else:
            config = FlowConfig.full(meanflow) if args.size == "full" else FlowConfig.small(meanflow)
            flow, repo = random_flow(config, seed=args.seed).eval(), None
        if repo is None:
            repo = build_repo(flow, work / f"repo_{mode}", args.threads, args.batching)
        here = want_batching and args.batching_size == "full" and mode == "regular"
        measure_mode(mode, flow, repo, args, report, batching_here=here)
        del flow
    if want_batching and args.batching_size == "small":
        small = random_flow(FlowConfig.small(), seed=args.seed).eval()
        repo = build_repo(small, work / "repo_small", args.threads, args.batching)
        with TritonServer(repo, log_file=work / "server_small.log") as server:
            measure_batching(server, small.config.n_feats, args, report, steps=10)

    report.gemm.append(gemm_rate())
    report.load.append(os.getloadavg()[0])
    body = write_report(report, args.out)
    ratios = markdown(RATIO_HEADER, ratio_table(report))
    print(ratios)
    print(f"\n(GEMM {report.gemm_rate:.0f} GFLOP/s; {time.perf_counter() - t_start:.0f} s in all; "
          f"details in {args.out})")
    del body
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    if report.failures:
        print("FAILED self-checks:\n  " + "\n  ".join(report.failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
