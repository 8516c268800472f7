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
eager, served first chunk against in-process) and exits non-zero when one is off.

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
import platform
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backend"))  # fallback when the package is not installed
sys.path.insert(0, str(ROOT / "client"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from s3flow.model.checkpoint import load_flow, random_flow  # noqa: E402
from s3flow.model.flops import chunk_calls, estimator_flops, solve_flops  # noqa: E402
from s3flow.model.flow import FlowConfig, TorchEstimator, synthesize  # noqa: E402
from s3flow.runtime.ort import OrtEncoder, OrtEstimator, OrtSettings  # noqa: E402
from s3flow.protocol import Limits, parse_request  # noqa: E402
from s3flow.engine.streaming import planned_calls  # noqa: E402
from s3flow.serving.repository import Batching, RepositorySettings, write_repository  # noqa: E402
from s3flow.engine.streaming import StreamingEngine  # noqa: E402
from s3flow.serving.triton_server import TritonServer  # noqa: E402
from s3flow_client import StreamingClient, Utterance, chunk_schedule  # noqa: E402
from s3flow_client.demo import demo_utterance  # noqa: E402

STEPS = {"regular": 10, "meanflow": 2}
TARGETS = {
    "served_vs_eager": 1.3, "outside_share": 0.05, "estimator_rate": 0.85, "meanflow_vs_regular": 7.0,
    "batching": 1.3, "first_chunk": 0.2, "served_vs_ort": 1.05,
}
#: Absolute mel tolerance of the self-checks (ONNX Runtime vs torch after 10 steps is ~1e-4 here).
MEL_ATOL = 5e-3
#: Chunk schedule of the streamed runs: first chunk, growth, largest (tokens).
SCHEDULE = (10, 2.0, 100)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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

    def __call__(self, x, mask, mu, t, spks, cond, r=None):
        t0 = time.perf_counter()
        v = self.fn(x, mask, mu, t, spks, cond, r)
        self.seconds += time.perf_counter() - t0
        self.calls.append((int(x.shape[0]), int(x.shape[2])))
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


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def machine() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__}
    try:
        import onnxruntime
        info["onnxruntime"] = onnxruntime.__version__
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
        info["simd"] = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
                                if f in flags) or "?"
        mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        info["memory"] = f"{int(mem.split()[1]) / 2**20:.0f} GiB"
    except (OSError, StopIteration, ImportError):
        pass
    return info


# ---------------------------------------------------------------------------------------------------
# Requests, in process and served


def request_inputs(u: Utterance, lo: int, hi: int, first: bool) -> dict:
    """The tensors of one chunk request, as the client sends them (batch dimension 1)."""
    inputs = {"speech_tokens": u.speech_tokens[lo:hi][None].astype(np.int64)}
    if first:
        inputs.update(prompt_tokens=u.prompt_tokens[None], prompt_mel=u.prompt_mel[None],
                      speaker_embedding=u.speaker_embedding[None], seed=np.array([[u.seed]], dtype=np.int64))
        if u.n_timesteps is not None:
            inputs["n_timesteps"] = np.array([[u.n_timesteps]], dtype=np.int32)
    return inputs


def engine_chunk(engine: StreamingEngine, u: Utterance, n_tokens: int, final: bool, corr_id: int = 1):
    """Time the first chunk (n_tokens) of u through an in-process engine; return (seconds, mel)."""
    t0 = time.perf_counter()
    req = parse_request(request_inputs(u, 0, n_tokens, True), start=True, end=final, limits=engine.limits,
                        n_feats=engine.n_feats)
    [res] = engine.run([engine.admit(corr_id, req)])
    seconds = time.perf_counter() - t0
    engine.store.drop(corr_id)
    return seconds, res.mel


class ServerStats:
    """Deltas of Triton's per-model statistics (compute_infer time, requests, executions)."""

    MODELS = ("cfm_solver", "flow_encoder", "estimator")

    def __init__(self, server: TritonServer):
        self.client = server.client()
        self.before = self._read()

    def _read(self) -> dict:
        out = {}
        for m in self.MODELS:
            s = self.client.get_inference_statistics(m).model_stats[0]
            out[m] = (s.inference_stats.compute_infer.ns / 1e9, int(s.inference_count), int(s.execution_count))
        return out

    def delta(self) -> dict:
        after = self._read()
        return {m: tuple(a - b for a, b in zip(after[m], self.before[m])) for m in self.MODELS}


# ---------------------------------------------------------------------------------------------------
# Results


@dataclass
class PathResult:
    """One path (eager / ort / served) on one utterance in one mode."""
    offline_s: float = float("nan")
    first_chunk_s: float = float("nan")
    stream_wall_s: float = float("nan")
    nfe_offline: int = 0
    nfe_stream: int = 0
    estimator_s: float = float("nan")      # time inside the estimator during the offline run
    flops: int = 0                         # estimator FLOPs of the offline run
    encoder_s: float = float("nan")        # served: flow_encoder compute time during the offline run
    stream_estimator_s: float = float("nan")
    stream_flops: int = 0


@dataclass
class CaseResult:
    mode: str
    seconds: float
    audio_s: float
    frames: int                             # estimator frames of the offline run (prompt included)
    paths: dict = field(default_factory=dict)   # "eager" / "ort" / "served" -> PathResult
    checks: dict = field(default_factory=dict)  # name -> max abs difference


@dataclass
class LoadResult:
    streams: int
    audio_s: float                 # audio of the utterances that completed
    wall_s: float
    latencies: list                # every chunk's latency (s)
    first_chunks: list = field(default_factory=list)
    requests: int = 0              # cfm_solver requests and executions (Triton statistics)
    executions: int = 0
    errors: list = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.audio_s / self.wall_s


@dataclass
class Report:
    settings: dict
    machine: dict
    gemm: list = field(default_factory=list)       # GFLOP/s measured at start and end
    load: list = field(default_factory=list)       # load averages at start and end
    cases: list = field(default_factory=list)
    micro: dict = field(default_factory=dict)      # frames -> {path: seconds per forward at B = 2}
    micro_flops: dict = field(default_factory=dict)
    batching: list = field(default_factory=list)   # (concurrent LoadResult, one-at-a-time LoadResult)
    batching_size: str = ""
    failures: list = field(default_factory=list)

    @property
    def gemm_rate(self) -> float:
        return max(self.gemm)


# ---------------------------------------------------------------------------------------------------
# The measurements


def utterances(seconds: list[float], prompt_seconds: float) -> list[Utterance]:
    return [demo_utterance(s, seed=100 + k, noise_seed=k, prompt_seconds=prompt_seconds)
            for k, s in enumerate(seconds)]


MICRO_FRAMES = (300, 64)
MICRO_PATHS = {"eager": "eager torch", "ort_plain": "ONNX Runtime, file as exported",
               "ort": "ONNX Runtime, CPU rewrite (served default)"}


def measure_estimator_alone(flow, repo: Path, args, report: Report) -> None:
    """One estimator forward at B = 2 (one guided utterance), T = 300 and 64 frames: eager, ONNX Runtime on
    the file as exported, and with the load-time CPU rewrite; interleaved, best of N."""
    from s3flow.runtime.onnx_export import make_estimator_inputs

    path = repo / "estimator" / "1" / "model.onnx"
    fns = {"eager": TorchEstimator(flow.estimator),
           "ort_plain": OrtEstimator(path, OrtSettings(threads=args.threads, rewrite=False)),
           "ort": OrtEstimator(path, OrtSettings(threads=args.threads))}
    reps = max(args.repeats, 2) + 1
    for frames in MICRO_FRAMES:
        inputs = make_estimator_inputs(flow.estimator, 2, frames, lengths=[frames, frames])
        for fn in fns.values():
            fn(**inputs)
        times = {k: [] for k in fns}
        for _ in range(reps if frames >= 300 else 3 * reps):   # interleaved: all see the same machine
            for name, fn in fns.items():
                times[name].append(_timed(lambda: fn(**inputs)))
        report.micro[frames] = {k: min(v) for k, v in times.items()}
        report.micro_flops[frames] = estimator_flops(flow.config.estimator, 2, frames).total
        log(f"estimator alone, B=2 T={frames}: " + ", ".join(f"{k} {v:.3f} s" for k, v in report.micro[frames].items()))


def measure_mode(mode: str, flow, repo: Path, args, report: Report, batching_here: bool) -> None:
    steps = STEPS[mode]
    meanflow = flow.config.meanflow
    cfg = flow.config.estimator
    threads = args.threads
    limits = Limits()
    ort_settings = OrtSettings(threads=threads)

    eager_est = TimedEstimator(TorchEstimator(flow.estimator))

    def encode_torch(tokens, token_len, embedding):
        with torch.inference_mode():
            return flow.encoder(tokens, token_len, embedding)

    eager_engine = StreamingEngine(encode_torch, eager_est, n_feats=flow.config.n_feats, meanflow=meanflow,
                                   limits=limits)
    ort_est = TimedEstimator(OrtEstimator(repo / "estimator" / "1" / "model.onnx", ort_settings))
    ort_enc = OrtEncoder(repo / "flow_encoder" / "1" / "model.onnx", OrtSettings(threads=threads))
    ort_engine = StreamingEngine(ort_enc, ort_est, n_feats=flow.config.n_feats, meanflow=meanflow, limits=limits)

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
            case = CaseResult(mode=mode, seconds=seconds, audio_s=2 * n / 50.0, frames=frames)
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
                                                                 limits.context_frames, steps, meanflow=meanflow))
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


def batching_load(n_streams: int, seconds: float, prompt_seconds: float, steps: Optional[int]) -> list[Utterance]:
    """n_streams utterances of about ``seconds`` (lengths vary by +-20 %), each with its own voice and seed."""
    out = []
    for i in range(n_streams):
        length = seconds * (1.0 + 0.2 * ((i % 5) - 2) / 2)
        u = demo_utterance(length, seed=300 + i, noise_seed=i, prompt_seconds=prompt_seconds)
        u.chunks = chunk_schedule(len(u.speech_tokens), *SCHEDULE)
        u.n_timesteps = steps
        out.append(u)
    return out


def run_load(url: str, utts: list[Utterance], concurrent: bool, server: Optional[TritonServer] = None,
             stagger_s: float = 0.0, timeout_s: float = 3600.0) -> LoadResult:
    """Stream utts all at once (one gRPC stream; or, with ``stagger_s`` > 0, one client each, started that
    many seconds apart), or one after the other; measure the wall time. Failed utterances are counted in
    ``errors``, not raised."""
    import threading
    from s3flow_client import StreamError

    client = StreamingClient(url, timeout_s=timeout_s)
    stats = ServerStats(server) if server is not None else None
    results, errors = [], []

    def one(batch):
        try:
            results.extend(client.synthesize(batch))
        except StreamError as exc:
            results.extend(r for r in exc.results if r.error is None)
            errors.extend(r.error for r in exc.results if r.error is not None)

    t0 = time.perf_counter()
    if not concurrent:
        for u in utts:
            one([u])
    elif stagger_s <= 0:
        one(utts)
    else:
        threads = [threading.Thread(target=one, args=([u],)) for u in utts]
        for k, th in enumerate(threads):
            time.sleep(max(t0 + k * stagger_s - time.perf_counter(), 0.0))
            th.start()
        for th in threads:
            th.join()
    wall = time.perf_counter() - t0
    load = LoadResult(streams=len(utts), audio_s=sum(r.audio_s for r in results), wall_s=wall,
                      latencies=[x for r in results for x in r.chunk_latencies_s],
                      first_chunks=[r.first_chunk_s for r in results], errors=errors)
    if stats is not None:
        d = stats.delta()["cfm_solver"]
        load.requests, load.executions = d[1], d[2]
    return load


def measure_batching(server: TritonServer, n_feats: int, args, report: Report, steps: Optional[int]) -> None:
    streams = args.streams
    utts = batching_load(max(streams), args.batch_seconds, args.prompt_seconds, steps)
    log(f"batching ({report.batching_size}): {max(streams)} utterances of ~{args.batch_seconds:g} s, "
        f"each alone, then {streams} at once")
    run_load(server.grpc_url, utts[:1], concurrent=False)   # warm-up
    alone = [run_load(server.grpc_url, [u], concurrent=False, server=server) for u in utts]
    for n in streams:
        together = run_load(server.grpc_url, utts[:n], concurrent=True, server=server)
        for err in together.errors + [e for a in alone[:n] for e in a.errors]:
            report.failures.append(f"batching, {n} streams: {err}")
        one_by_one = LoadResult(streams=n, audio_s=sum(a.audio_s for a in alone[:n]),
                                wall_s=sum(a.wall_s for a in alone[:n]),
                                latencies=[x for a in alone[:n] for x in a.latencies],
                                requests=sum(a.requests for a in alone[:n]),
                                executions=sum(a.executions for a in alone[:n]))
        report.batching.append((together, one_by_one))
        log(f"  {n} streams: {together.throughput:.2f} audio s/s together vs {one_by_one.throughput:.2f} one at "
            f"a time ({together.requests / max(together.executions, 1):.2f} chunks per execute)")


# ---------------------------------------------------------------------------------------------------
# Tables


def fmt(x: float, spec: str = ".2f", unit: str = "") -> str:
    return "–" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:{spec}}{unit}"


def ratio_table(report: Report) -> list[list[str]]:
    rows = []
    gemm = report.gemm_rate
    reg = [c for c in report.cases if c.mode == "regular"]
    mf = {c.seconds: c for c in report.cases if c.mode == "meanflow"}

    def verdict(ok: Optional[bool]) -> str:
        return "–" if ok is None else ("reached" if ok else "not reached")

    if reg:
        vals = [(c.seconds, c.paths["eager"].offline_s / c.paths["served"].offline_s) for c in reg]
        rows.append(["served offline 10-step synthesis vs eager reference (speed-up)",
                     " / ".join(f"{s:g} s: {v:.2f}x" for s, v in vals), f">= {TARGETS['served_vs_eager']}x",
                     verdict(min(v for _, v in vals) >= TARGETS["served_vs_eager"])])
        vals = [(c.seconds, c.paths["ort"].offline_s and c.paths["eager"].offline_s / c.paths["ort"].offline_s)
                for c in reg]
        rows.append(["(for reference) ONNX Runtime in process vs eager",
                     " / ".join(f"{s:g} s: {v:.2f}x" for s, v in vals), "", ""])
        # the stubs' thread pools (estimator, encoder, solver, Triton's) must not fight: served within 5 %
        # of the same ONNX files in process (threads derived from the cores, s3flow.runtime.ort.auto_threads)
        vals = [(c.seconds, c.paths["served"].offline_s / c.paths["ort"].offline_s) for c in reg
                if c.paths["ort"].offline_s]
        if vals:
            rows.append([f"served offline vs ONNX Runtime in process, {report.settings['threads']} thread(s) (time ratio)",
                         " / ".join(f"{s:g} s: {v:.3f}" for s, v in vals), f"<= {TARGETS['served_vs_ort']}",
                         verdict(max(v for _, v in vals) <= TARGETS["served_vs_ort"])])
        big = [c for c in reg if c.frames >= 300]
        if big:
            vals = [(c.seconds, c.frames, 1 - c.paths["served"].estimator_s / c.paths["served"].offline_s) for c in big]
            enc = [(c.paths["served"].encoder_s / c.paths["served"].offline_s) for c in big]
            rows.append(["time outside the estimator, served offline, T >= 300 frames",
                         " / ".join(f"{s:g} s (T {t}): {100 * v:.1f}%" for s, t, v in vals)
                         + f" (of which the encoder {' / '.join(f'{100 * e:.1f}%' for e in enc)})",
                         f"< {100 * TARGETS['outside_share']:.0f}%",
                         verdict(max(v for _, _, v in vals) < TARGETS["outside_share"])])
    if 300 in report.micro:
        flops, m = report.micro_flops[300], report.micro[300]
        e, o = flops / m["eager"] / 1e9, flops / m["ort"] / 1e9
        rows.append(["estimator achieved rate at B = 2, T = 300 (share of the GEMM rate)",
                     f"ONNX Runtime {o:.0f} GFLOP/s = {100 * o / gemm:.0f}%; eager {e:.0f} GFLOP/s = "
                     f"{100 * e / gemm:.0f}% (GEMM {gemm:.0f} GFLOP/s)", f">= {100 * TARGETS['estimator_rate']:.0f}%",
                     verdict(o / gemm >= TARGETS["estimator_rate"])])
    pairs = [(c, mf[c.seconds]) for c in reg if c.seconds in mf]
    if pairs:
        vals = [(c.seconds, c.paths["served"].offline_s / m.paths["served"].offline_s) for c, m in pairs]
        rows.append(["meanflow 2 steps vs regular 10 steps, served offline (speed-up)",
                     " / ".join(f"{s:g} s: {v:.1f}x" for s, v in vals), f">= {TARGETS['meanflow_vs_regular']:g}x",
                     verdict(min(v for _, v in vals) >= TARGETS["meanflow_vs_regular"])])
    if report.batching:
        together, alone = report.batching[-1]
        r = together.throughput / alone.throughput
        rows.append([f"throughput at {together.streams} streams vs one at a time ({report.batching_size})",
                     f"{r:.2f}x ({together.throughput:.2f} vs {alone.throughput:.2f} audio s per s)",
                     f">= {TARGETS['batching']}x", verdict(r >= TARGETS["batching"])])
    if reg:
        c = max(reg, key=lambda c: c.seconds)
        v = c.paths["served"].first_chunk_s / c.paths["served"].offline_s
        rows.append([f"streaming first chunk vs offline latency, {c.seconds:g} s utterance, served",
                     f"{v:.3f} ({c.paths['served'].first_chunk_s:.2f} s vs {c.paths['served'].offline_s:.2f} s)",
                     f"< {TARGETS['first_chunk']} (10 s)", verdict(v < TARGETS["first_chunk"]) if c.seconds >= 10
                     else "– (no 10 s run)"])
    return rows


def detail_table(report: Report) -> list[list[str]]:
    gemm = report.gemm_rate
    rows = []
    for c in report.cases:
        for name, label in (("eager", "(a) eager"), ("ort", "(b) ORT in process"), ("served", "(c) served")):
            p = c.paths[name]
            rate = p.flops / p.estimator_s / 1e9 if p.estimator_s == p.estimator_s and p.estimator_s > 0 else float("nan")
            outside = 1 - p.estimator_s / p.offline_s if name == "served" else float("nan")
            stream_rtf = p.stream_wall_s / c.audio_s if name == "served" else float("nan")
            rows.append([c.mode, f"{c.seconds:g}", str(c.frames), label, fmt(p.offline_s), fmt(p.offline_s / c.audio_s, ".3f"),
                         fmt(p.first_chunk_s, ".3f"), fmt(stream_rtf, ".3f"),
                         f"{p.nfe_offline} / {p.nfe_stream}", fmt(rate, ".0f"), fmt(100 * rate / gemm, ".0f", "%"),
                         fmt(100 * outside, ".1f", "%") if name == "served" else "–"])
    return rows


def batching_table(report: Report) -> list[list[str]]:
    rows = []
    for together, alone in report.batching:
        rows.append([str(together.streams), f"{together.audio_s:.1f}",
                     f"{together.throughput:.2f}", fmt(percentile(together.latencies, 50), ".2f"),
                     fmt(percentile(together.latencies, 99), ".2f"),
                     f"{together.requests / max(together.executions, 1):.2f}",
                     f"{alone.throughput:.2f}", fmt(percentile(alone.latencies, 50), ".2f"),
                     fmt(percentile(alone.latencies, 99), ".2f"), f"{together.throughput / alone.throughput:.2f}x"])
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


RATIO_HEADER = ["figure", "measured", "target", ""]
DETAIL_HEADER = ["mode", "audio s", "T", "path", "offline s", "RTF offline", "first chunk s", "RTF stream",
                 "NFE offline / stream", "estimator GFLOP/s", "of GEMM", "outside estimator"]
BATCH_HEADER = ["streams", "audio s", "together: audio s/s", "p50 chunk s", "p99 chunk s", "chunks per execute",
                "one at a time: audio s/s", "p50 chunk s", "p99 chunk s", "throughput ratio"]


def write_report(report: Report, path: Path) -> str:
    m, s = report.machine, report.settings
    text = [
        "# Benchmark: eager reference vs ONNX Runtime in process vs served (Triton)",
        "",
        f"Written by `scripts/benchmark.py` on {time.strftime('%Y-%m-%d %H:%M')}; command: `{s['command']}`.",
        "",
        "## Machine and settings",
        "",
        f"- CPU: {m.get('cpu')}, {m.get('cores')} cores, {m.get('simd', '?')}; memory {m.get('memory', '?')}",
        f"- torch {m.get('torch')}, onnxruntime {m.get('onnxruntime')}, Python {m.get('python')}; "
        f"{s['threads']} threads for torch and ONNX Runtime, fp32",
        f"- fp32 GEMM rate (torch.matmul 2048 x 2048, {s['threads']} threads, best of 5), start / end of the run: "
        + " / ".join(f"{g:.0f}" for g in report.gemm) + " GFLOP/s; the higher one is the reference",
        f"- load average (1 min) at start / end: {' / '.join(f'{x:.2f}' for x in report.load)}"
        + (" — other work was running; timings are noisy, ratios measured side by side hold better"
           if max(report.load) > 0.5 * (m.get('cores') or 2) else ""),
        f"- model: {s['size']} size, seeded random weights (seed {s['seed']}) unless a checkpoint is named: {s['checkpoint']}",
        f"- utterances: {', '.join(f'{x:g}' for x in s['seconds'])} s of speech tokens after a {s['prompt_seconds']:g} s "
        f"prompt; regular = 10 Euler steps, guided (B = 2 per utterance); meanflow = 2 steps, B = 1",
        f"- streaming chunk schedule: first {SCHEDULE[0]} tokens, x{SCHEDULE[1]:g}, at most {SCHEDULE[2]} "
        f"(each chunk re-runs the prefix); offline = one request with every token",
        f"- timings: best of {s['repeats']} (offline, first chunk); the served stream once; "
        f"batching section: {report.batching_size}",
        f"- served repository: {s['batching']}",
        "",
        "## Ratios against the targets",
        "",
        markdown(RATIO_HEADER, ratio_table(report)),
        "",
        "## Detail",
        "",
        "Offline latency is tokens-in to mel-out of the whole utterance; first chunk is the first streamed chunk's "
        "latency (in process: that chunk through the engine; served: at the client). RTF = seconds per second of "
        "audio. Estimator GFLOP/s = counted FLOPs (`s3flow.model.flops`) over the time inside the estimator (in process: "
        "timed around each call; served: the estimator model's compute_infer from Triton's statistics). Outside "
        "estimator = 1 - estimator time / offline latency (encoder, BLS, gRPC, copies, solver).",
        "",
        markdown(DETAIL_HEADER, detail_table(report)),
        "",
    ]
    if report.micro:
        text += ["## The estimator alone", "",
                 f"One forward at B = 2 (one guided utterance), interleaved, best of {max(s['repeats'], 2) + 1} "
                 "(T = 64: three times as many). The CPU rewrite (`s3flow.runtime.ort.rewrite_for_cpu`, applied when "
                 "the session is made) computes Mish in exp form and attention as one MultiHeadAttention node.", "",
                 markdown(["T", "GFLOP"] + [f"{v} s (GFLOP/s, of GEMM)" for v in MICRO_PATHS.values()]
                          + ["rewrite speed-up"],
                          [[str(t), f"{report.micro_flops[t] / 1e9:.1f}"]
                           + [f"{m[k]:.3f} ({report.micro_flops[t] / m[k] / 1e9:.0f}, "
                              f"{100 * report.micro_flops[t] / m[k] / 1e9 / report.gemm_rate:.0f}%)" for k in MICRO_PATHS]
                           + [f"{m['ort_plain'] / m['ort']:.2f}x"]
                           for t, m in report.micro.items()]), ""]
    if report.batching:
        text += ["## Batching across utterances (served, `oldest` strategy)", "",
                 f"{report.batching_size}. Each load: N utterances of about {s['batch_seconds']:g} s (lengths vary by "
                 "+-20 %), streamed all at once over one gRPC stream ('together'), against the same utterances "
                 "streamed one after the other ('one at a time'; its wall time is the sum). Chunks per execute = "
                 "requests / executions of cfm_solver (Triton statistics). p99 over so few chunks is close to the "
                 "maximum.", "", markdown(BATCH_HEADER, batching_table(report)), ""]
    text += ["## Self-checks", ""]
    for c in report.cases:
        text.append(f"- {c.mode} {c.seconds:g} s: " + "; ".join(f"{k} {v:.1e}" for k, v in c.checks.items()))
    text.append(f"- tolerance {MEL_ATOL:g} (absolute, mel); "
                + ("all within" if not report.failures else "FAILED: " + "; ".join(report.failures)))
    text.append("")
    body = "\n".join(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return body


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
    write_repository(out, flow, RepositorySettings(limits=Limits(), batching=batching, ort_threads=threads))
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
