"""The benchmark's results, settings and tables (``scripts/benchmark.py`` measures; this writes them down).

:class:`Report` holds one run: the machine, the settings, one :class:`CaseResult` per mode and utterance
(a :class:`PathResult` per path: eager, ONNX Runtime in process, served), the estimator alone, the batching
loads (``s3flow_tools.bench.served.LoadResult``) and the failed self-checks. :func:`write_report` writes the
markdown (ratios against :data:`TARGETS` first); :func:`markdown` and :func:`fmt` make its tables.
"""
from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

TARGETS = {
    "served_vs_eager": 1.3, "outside_share": 0.05, "estimator_rate": 0.85, "meanflow_vs_regular": 7.0,
    "batching": 1.3, "first_chunk": 0.2, "served_vs_ort": 1.05,
}
#: Absolute mel tolerance of the self-checks (ONNX Runtime vs torch after 10 steps is ~1e-4 here).
MEL_ATOL = 5e-3
#: Chunk schedule of the streamed runs: first chunk, growth, largest (tokens).
SCHEDULE = (10, 2.0, 100)
#: The estimator-alone paths and their labels.
MICRO_PATHS = {"eager": "eager torch", "ort_plain": "ONNX Runtime, file as exported",
               "ort": "ONNX Runtime, CPU rewrite (served default)"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def machine() -> dict:
    import torch

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
        f"(bounded context: each chunk solves the prompt, the last context_frames emitted frames and its new "
        f"tokens); offline = one request with every token",
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
                 "(T = 64: three times as many). The CPU rewrite (`s3flow.runtime.ort_rewrite.rewrite_for_cpu`, applied when "
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
