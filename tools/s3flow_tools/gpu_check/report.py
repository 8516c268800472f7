"""A device check's plumbing: the report (named checks against bounds, markdown sections), the clock, the
host's environment (scripts/gpu_check.py writes them as ``gpu_check.md`` / ``gpu_check.json``)."""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from s3flow.runtime import tensorrt as tb

#: Relative L2 bounds of the check (the final mel against CPU fp32; audio for the vocoder rows).
BOUNDS = {"fp32": 1e-3, "tf32": 1e-2, "fp16": 2e-2, "bf16": 5e-2, "trt-fp16": tb.PARITY_BOUNDS["fp16"],
          "trt-fp32": tb.PARITY_BOUNDS["fp32"], "streamed": 1e-3, "vocoder": 1e-4, "vocoder-streamed": 1e-5}


class Clock:
    """Wall time of a callable: median of ``iters`` runs after ``warmup`` (CUDA events on a GPU)."""

    def __init__(self, device: torch.device, warmup: int, iters: int):
        self.device, self.warmup, self.iters = device, warmup, iters

    def ms(self, fn) -> float:
        return self.run(fn)[1]

    def run(self, fn):
        """(fn's last result, median ms)."""
        for _ in range(self.warmup):
            fn()
        times, out = [], None
        for _ in range(self.iters):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                out = fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return out, float(np.median(times))



@dataclass
class Report:
    device: str
    plan: object                                   # the run's flows.Plan
    env: dict = field(default_factory=dict)
    sections: list = field(default_factory=list)   # (title, markdown body)
    checks: list = field(default_factory=list)     # {name, value, bound, ok}
    data: dict = field(default_factory=dict)

    def check(self, name: str, rel: float, finite: bool, bound: float) -> bool:
        ok = bool(finite and rel <= bound)
        self.checks.append({"name": name, "rel_error": rel, "finite": finite, "bound": bound, "ok": ok})
        return ok

    def fail(self, name: str, why: str) -> None:
        self.checks.append({"name": name, "rel_error": None, "finite": None, "bound": None, "ok": False,
                            "error": why})

    def add(self, title: str, body: str) -> None:
        self.sections.append((title, body))
        print(f"\n## {title}\n{body}", flush=True)

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)

    def markdown(self) -> str:
        lines = ["# GPU check", ""]
        if self.device == "cpu":
            lines += ["**Run on the CPU (`--device cpu`): a check of the script's code paths, not GPU figures.**", ""]
        lines += ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in self.env.items()] + [""]
        lines += ["## Verdict", "", f"**{'PASS' if self.ok else 'FAIL'}** "
                  f"({sum(c['ok'] for c in self.checks)} of {len(self.checks)} checks passed)", "",
                  "| check | rel. error | finite | bound | result |", "| --- | --- | --- | --- | --- |"]
        for c in self.checks:
            if c.get("error"):
                lines.append(f"| {c['name']} | - | - | - | FAIL: {c['error'][:120]} |")
            else:
                lines.append(f"| {c['name']} | {c['rel_error']:.2e} | {c['finite']} | {c['bound']:.0e} | "
                             f"{'ok' if c['ok'] else 'FAIL'} |")
        for title, body in self.sections:
            lines += ["", f"## {title}", "", body]
        return "\n".join(lines) + "\n"


def table(header: list, rows: list) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    p = tb.compare(out, ref, 1.0)
    return p.rel_error, p.finite


# ---------------------------------------------------------------------------------------------------
# sections


def environment(device: torch.device) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
           "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "cpu threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update({"gpu": p.name, "compute capability": f"{p.major}.{p.minor}",
                    "gpu memory": f"{p.total_memory / 2**30:.0f} GiB", "cuda (torch)": torch.version.cuda})
    trt = tb.tensorrt_version()
    env["tensorrt"] = trt or f"not importable (trtexec: {tb.find_trtexec() or 'not found'})"
    for mod in ("onnx", "onnxruntime", "safetensors"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = "missing"
    return env


