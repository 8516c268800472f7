"""Triton Model Analyzer, installed into the project and run against the repository of the trained teacher.

Model Analyzer (``triton-model-analyzer`` on PyPI) is the tool Triton users run to choose instance counts and
batch sizes: it writes config variants of a model into a repository of its own, launches ``tritonserver`` for
each (``triton_launch_mode: local``: the project's server binary, backend folder and environment, as
``s3flow.server.triton_server.TritonServer`` starts it), and drives it with perf_analyzer. :func:`install`
puts it into a virtual environment of its own (``.tools/model-analyzer``, git-ignored: it pins optuna,
numba and cuda-python, none of which the server needs).

What it searches here: ``cfm_solver`` as a BLS model with its composing models ``flow_encoder`` and
``estimator`` (``run_config_search_mode: quick``, its only mode for BLS): the instance count of each and the
solver's ``max_batch_size``, at perf_analyzer concurrencies up to ``--max-concurrency``, streaming the held-out
sentences of ``scripts/perf_inputs.py`` as sequences. Three things stop it from driving more, and what we do:

* the ensembles: Model Analyzer loads an ensemble's steps only, and ``cfm_solver`` calls ``flow_encoder`` and
  ``estimator`` through BLS, so every request of ``token2mel`` failed with "Model 'flow_encoder' is not ready";
  so the solver is profiled as the BLS model it is (the ensembles add only the admission step and, on
  ``token2wav``, the vocoder);
* perf_analyzer (2.41.1, the last wheel that carries it) sends no correlation id to a sequence model when it is
  given ``--bls-composing-models`` ("must specify a non-zero or non-empty correlation ID"), and Model Analyzer
  takes no ``--sequence-length-variation`` (perf_analyzer's default varies each sequence by 20 %, and a
  sequence longer than its recorded steps wraps round to the START step: refused). :data:`PA_WRAPPER`, the
  perf_analyzer Model Analyzer is given, drops the first flag and adds the second (so its report lacks the
  composing models' server-side times; throughput and latency are the solver's own);
* knobs outside a model config's instance group and max batch size (ONNX Runtime's threads, the sequence
  batcher's strategy and queue delay, the solver's scheduling) are not searched; ``python -m
  s3flow_tools.measure.batching`` sweeps those.

Its measure is perf_analyzer's: requests (chunks) per second with each chunk sent as soon as the last is
answered, not seconds of audio per second of streams at real time; :func:`main` therefore builds Model Analyzer's
best configuration and the shipped default as repositories and measures C of both on ``token2mel`` and
``token2wav`` in the same run (``s3flow_tools.measure.layout.measure_server``): ``results/model_analyzer.md``.

Examples::

    .venv/bin/python -m s3flow_tools.model_analyzer install
    .venv/bin/python -m s3flow_tools.model_analyzer profile                       # ~25 min on 2 cores
    .venv/bin/python -m s3flow_tools.model_analyzer profile --max-concurrency 2 --max-instances 1 \\
        --max-batch-size 1 --no-compare --out /tmp/ma.md                           # a small search, ~3 min
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from s3flow.server.triton_server import TritonServer, free_port
from s3flow_tools import perf_analyzer

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".tools" / "model-analyzer"
VERSION = "1.58.0"
#: the models searched: the solver as a BLS model over the two it calls
PROFILED, COMPOSING = "cfm_solver", ("flow_encoder", "estimator")
SEQUENCE_LENGTH = 4
#: the perf_analyzer Model Analyzer runs (module docstring): without --bls-composing-models, with
#: --sequence-length-variation 0
PA_WRAPPER = """#!/bin/sh
# perf_analyzer for Model Analyzer (s3flow_tools.model_analyzer): drops --bls-composing-models (perf_analyzer
# 2.41.1 then sends no correlation id to a sequence model) and plays every sequence at its recorded length
skip=0
for a in "$@"; do
  shift
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  if [ "$a" = "--bls-composing-models" ]; then skip=1; continue; fi
  set -- "$@" "$a"
done
exec {binary} "$@" --sequence-length-variation 0
"""


def executable(home: Path = HOME) -> Path:
    return home / "bin" / "model-analyzer"


def version(home: Path = HOME) -> Optional[str]:
    """The installed Model Analyzer's version (None: not installed, or it does not start)."""
    try:
        out = subprocess.run([str(executable(home)), "--version"], capture_output=True, text=True, timeout=120)
    except OSError:
        return None
    said = (out.stdout + out.stderr).strip().splitlines()
    return said[-1].strip() if out.returncode == 0 and said else None


def install(home: Path = HOME, python: str = "/usr/bin/python3.11") -> str:
    """Model Analyzer into its own virtual environment at ``home`` (nothing done if it already runs)."""
    found = version(home)
    if found:
        return found
    if not Path(python).exists():
        python = sys.executable
    subprocess.run([python, "-m", "venv", str(home)], check=True)
    subprocess.run([str(home / "bin" / "pip"), "install", "-q", f"triton-model-analyzer=={VERSION}", "numpy<2"],
                   check=True)
    found = version(home)
    if not found:
        raise RuntimeError(f"Model Analyzer does not start from {executable(home)}")
    return found


@dataclass
class Search:
    """How far Model Analyzer searches (its ``run_config_search_max_*``)."""
    max_concurrency: int = 4
    max_instances: int = 2
    max_batch_size: int = 8
    concurrency_sweep: bool = True   # its best configurations measured again at every concurrency, for its reports


def config(repo: Path, work: Path, input_data: Path, search: Search, window_requests: int = 50,
           stability_percentage: int = 10) -> dict:
    """Model Analyzer's profile config: local launch of the project's tritonserver as TritonServer starts it,
    the wrapped perf_analyzer (written into ``work``), the BLS search (module docstring); perf_analyzer's windows
    of ``window_requests`` requests, stable when within ``stability_percentage`` % (its default 10; Model Analyzer
    measures again with more requests when they are not, which made the suite's small search 2-10 min on 2 noisy
    cores)."""
    server = TritonServer(repo)
    for name in ("grpc", "http", "metrics"):
        setattr(server, f"{name}_port", free_port(server.host))
    flags = dict(arg[2:].split("=", 1) for arg in server.command()[1:] if arg.startswith("--") and "=" in arg)
    env = server.environment()
    wrapper = work / "perf_analyzer"
    wrapper.write_text(PA_WRAPPER.format(binary=perf_analyzer.binary()))
    wrapper.chmod(0o755)
    return {
        "model_repository": str(repo),
        "output_model_repository_path": str(work / "variants"),
        "override_output_model_repository": True,
        "export_path": str(work / "export"),
        "checkpoint_directory": str(work / "checkpoints"),
        "triton_launch_mode": "local",
        "triton_server_path": str(server.paths.binary),
        "triton_output_path": str(work / "tritonserver.log"),   # (else a temp file its exit leaves behind)
        "triton_server_flags": {"backend_directory": flags["backend-directory"], "allow_gpu_metrics": False},
        "triton_server_environment": {k: env[k] for k in ("LD_LIBRARY_PATH", "PATH", "VIRTUAL_ENV",
                                                           "MALLOC_MMAP_THRESHOLD_") if k in env},
        "triton_http_endpoint": server.http_url,
        "triton_grpc_endpoint": server.grpc_url,
        "triton_metrics_url": f"http://{server.host}:{server.metrics_port}/metrics",
        "perf_analyzer_path": str(wrapper),
        "client_protocol": "grpc",
        "run_config_search_mode": "quick",
        "run_config_search_max_concurrency": search.max_concurrency,
        "run_config_search_max_instance_count": search.max_instances,
        "run_config_search_max_model_batch_size": search.max_batch_size,
        "concurrency_sweep_disable": not search.concurrency_sweep,
        "bls_composing_models": list(COMPOSING),
        "cpu_only_composing_models": list(COMPOSING),
        "profile_models": {PROFILED: {"cpu_only": True, "perf_analyzer_flags": {
            "input-data": str(input_data), "streaming": True, "sequence-length": SEQUENCE_LENGTH,
            "measurement-mode": "count_windows", "measurement-request-count": window_requests,
            "stability-percentage": stability_percentage}}},
    }


@dataclass
class Measured:
    """One measurement of Model Analyzer's: a configuration (the solver's variant with its composing models'
    variants) at one perf_analyzer concurrency."""
    instances: dict        # model -> instance count, solver and composing models
    max_batch_size: int    # the solver's
    concurrency: int
    per_s: float           # requests (chunks) per second
    p99_ms: float

    @property
    def flags(self) -> list[str]:
        """``scripts/build_repository.py``'s flags for this configuration."""
        return ["--solver-instances", str(self.instances[PROFILED]), "--encoder-instances",
                str(self.instances["flow_encoder"]), "--estimator-instances", str(self.instances["estimator"]),
                "--max-batch-size", str(self.max_batch_size)]

    def describe(self) -> str:
        return (f"{self.instances[PROFILED]} solver, {self.instances['flow_encoder']} encoder, "
                f"{self.instances['estimator']} estimator instances, max batch {self.max_batch_size}")


def _variant(variants: Path, name: str) -> tuple[int, int]:
    """Instance count and max batch size of the config variant ``name`` Model Analyzer wrote."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2
    cfg = text_format.Parse((variants / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return sum(g.count for g in cfg.instance_group), cfg.max_batch_size


def read_results(work: Path) -> list[Measured]:
    """Every measurement of a profile run in ``work``, from Model Analyzer's checkpoint (its CSV names the
    solver's variant only, not the composing models' it ran beside)."""
    [path] = sorted((work / "checkpoints").glob("*.ckpt"))[-1:]
    results = json.loads(path.read_text())["ResultManager.results"]["_results"][PROFILED]
    out = []
    for _, measurements in results.values():
        for key, m in measurements.items():
            solver, composing = key.split()[0], key.split()[-1].split(",")
            count, max_batch = _variant(work / "variants", solver)
            instances = {PROFILED: count, **{c.rsplit("_config_", 1)[0]: _variant(work / "variants", c)[0]
                                             for c in composing}}
            for model in m["_model_config_measurements"]:
                data = dict(model["_non_gpu_data"])
                out.append(Measured(instances, max_batch, int(model["_model_specific_pa_params"]["concurrency-range"]),
                                    data["perf_throughput"]["_value"], data["perf_latency_p99"]["_value"]))
    return out


def profile(repo: Path, work: Path, input_data: Path, search: Search, window_requests: int = 50,
            timeout_s: float = 3600, stability_percentage: int = 10) -> subprocess.CompletedProcess:
    """Run ``model-analyzer profile`` with :func:`config` (written to ``work/config.json``), perf_analyzer's
    windows ``window_requests`` requests each."""
    cfg = config(repo, work, input_data, search, window_requests, stability_percentage)
    path = work / "config.json"   # JSON is YAML
    path.write_text(json.dumps(cfg, indent=1))
    with (work / "model_analyzer.log").open("w") as log:   # its own output, kept beside its reports
        return subprocess.run([str(executable()), "profile", "-f", str(path)], cwd=work, stdout=log,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout_s)


def compare(best: Measured, at_once: int, c_runs: int, work: Path) -> dict:
    """C of Model Analyzer's best configuration and of the shipped default, on both ensembles, one server each
    in turn (``s3flow_tools.measure.layout.measure_server``): {label: {ensemble: {"first_s", "c"}}}."""
    from s3flow_tools.measure.layout import build_trained, measure_server
    out = {}
    for label, flags in (("shipped default", []), (f"Model Analyzer's best: {best.describe()}", best.flags)):
        repo = work / f"compare_{len(out)}"
        build_trained(repo, flags)
        with TritonServer(repo, log_file=work / f"compare_{len(out)}.log") as server:
            out[label] = measure_server(server.grpc_url, 1, at_once, c_runs)
    return out


def report(args, rows: list[Measured], compared: Optional[dict], seconds: float) -> str:
    import numpy as np
    from s3flow_tools.bench.report import machine
    from s3flow_tools.measure.layout import ENSEMBLES
    lines = ["# Triton Model Analyzer against the repository", "",
             f"Made by `python -m s3flow_tools.model_analyzer {' '.join(args.argv)}` on "
             f"{time.strftime('%Y-%m-%d %H:%M')} ({seconds / 60:.0f} min), {version()}, "
             f"{', '.join(f'{k} {v}' for k, v in machine().items())}. The trained small teacher's repository "
             f"(admission off); `cfm_solver` profiled as a BLS model over `flow_encoder` and `estimator` in quick "
             f"search (instances up to {args.max_instances}, the solver's max batch up to {args.max_batch_size}, "
             f"concurrency up to {args.max_concurrency}), streaming the held-out sentences of "
             f"`scripts/perf_inputs.py` ({SEQUENCE_LENGTH} chunks each). What it cannot drive, and why: the module "
             f"docstring of `s3flow_tools.model_analyzer` and docs/operations.md.", "",
             "## What it measured (chunks per second, each sent when the last is answered)", "",
             "| configuration | concurrency | chunks/s | p99 (ms) |", "| --- | ---: | ---: | ---: |"]
    for m in sorted(rows, key=lambda m: -m.per_s):
        lines.append(f"| {m.describe()} | {m.concurrency} | {m.per_s:.1f} | {m.p99_ms:.0f} |")
    lines.append("")
    if compared:
        labels = list(compared)
        lines += ["## Its best against the shipped default: C on both ensembles, the same run", "",
                  f"Each on a server of its own, in turn; per ensemble {args.c_runs} x {args.at_once} held-out "
                  f"sentences at once (C: seconds of audio per second).", "",
                  "| configuration | " + " | ".join(f"{m} C runs | {m} C median" for m in ENSEMBLES) + " |",
                  "| --- |" + " --- | ---: |" * len(ENSEMBLES)]
        for label in labels:
            lines.append(f"| {label} | " + " | ".join(
                f"{' '.join(f'{c:.2f}' for c in compared[label][m]['c'])} | {np.median(compared[label][m]['c']):.2f}"
                for m in ENSEMBLES) + " |")
        base = compared[labels[0]]
        lines += ["", "Its best vs the shipped default: " + ", ".join(
            f"{m} {np.median(compared[labels[1]][m]['c']) / np.median(base[m]['c']):.2f}x" for m in ENSEMBLES), ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m s3flow_tools.model_analyzer", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("install", help=f"install Model Analyzer {VERSION} into {HOME.relative_to(ROOT)}/")
    r = sub.add_parser("profile", help="search the trained teacher's repository, compare its best with ours")
    d = Search()
    r.add_argument("--max-concurrency", type=int, default=d.max_concurrency, help="(default: %(default)s)")
    r.add_argument("--max-instances", type=int, default=d.max_instances, help="(default: %(default)s)")
    r.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="(default: %(default)s)")
    r.add_argument("--no-concurrency-sweep", dest="concurrency_sweep", action="store_false",
                   help="skip measuring its best configurations again at every concurrency (for its reports)")
    r.add_argument("--build", default="", metavar="FLAGS",
                   help="scripts/build_repository.py flags of the repository searched, e.g. --build='--max-batch-size "
                        "1': Model Analyzer measures the repository's own configuration first at concurrency 2 x "
                        "instances x max batch size (default: the shipped layout)")
    r.add_argument("--work", type=Path, help="keep Model Analyzer's folder here: its config, the variants it "
                   "wrote, its checkpoint, its HTML reports under export/reports (default: a temporary folder)")
    r.add_argument("--window-requests", type=int, default=50,
                   help="perf_analyzer's requests per measurement window (default: %(default)s)")
    r.add_argument("--stability-percentage", type=int, default=10,
                   help="perf_analyzer's: windows within this many %% are stable (default: %(default)s)")
    r.add_argument("--no-compare", dest="compare", action="store_false",
                   help="skip measuring C of its best configuration and of the shipped default")
    r.add_argument("--at-once", type=int, default=16, help="streams that measure C (default: %(default)s)")
    r.add_argument("--c-runs", type=int, default=3, help="(default: %(default)s)")
    r.add_argument("--timeout-s", type=float, default=3600, help="(default: %(default)s)")
    r.add_argument("--out", type=Path, default=ROOT / "results" / "model_analyzer.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.what == "install":
        print(install())
        return 0
    if not version():
        raise SystemExit("Model Analyzer is not installed: make model-analyzer")
    if not perf_analyzer.version():
        raise SystemExit("perf_analyzer is not installed: make perf-analyzer")
    from s3flow_tools.measure.layout import build_trained
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="s3flow-model-analyzer-")))
        work.mkdir(parents=True, exist_ok=True)
        build_trained(work / "repo", shlex.split(args.build))
        inputs = work / "inputs.json"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "perf_inputs.py"), "--output", str(inputs)],
                       check=True, capture_output=True)
        search = Search(args.max_concurrency, args.max_instances, args.max_batch_size, args.concurrency_sweep)
        done = profile(work / "repo", work, inputs, search, args.window_requests, args.timeout_s,
                       args.stability_percentage)
        if done.returncode != 0:
            print((work / "model_analyzer.log").read_text()[-6000:], file=sys.stderr)
            raise SystemExit(f"model-analyzer profile failed (exit {done.returncode})")
        rows = read_results(work)
        if not rows:
            raise SystemExit("model-analyzer measured nothing")
        best = max(rows, key=lambda m: m.per_s)
        print(f"Model Analyzer's best: {best.describe()}, {best.per_s:.1f} chunks/s at concurrency "
              f"{best.concurrency}", flush=True)
        compared = compare(best, args.at_once, args.c_runs, work) if args.compare else None
    text = report(args, rows, compared, time.perf_counter() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
