"""Server-side batching experiments on today's server: one row per setting of a grid, both ensembles.

Each setting is a set of ``scripts/build_repository.py`` knobs; for each in turn it builds the repository of the
trained small teacher and its vocoder with them (admission off, so that every stream offered is served), starts
one server (loopback only), checks the server runs what the row names, and measures ``token2mel`` and
``token2wav`` as ``s3flow_tools.measure.layout`` does: ``--alone`` held-out sentences one after the other (first
mel, first audio), then ``--c-runs`` x ``--at-once`` held-out sentences started together (C: seconds of audio per
second of wall time). The table gives every run, the median, the ratio to the first setting and the spread of the
runs (max / min), which is this host's noise. The knobs:

  strategy (oldest | direct), max_batch_size, preferred_batch_sizes (joined by '+', e.g. 4+8),
  max_queue_delay_us, max_candidate_sequences, solver_instances, estimator_instances, encoder_instances,
  ort_threads (ONNX Runtime threads per estimator / encoder instance; 0 = the cores divided among them),
  scheduling (fifo | deadline), min_steps (deadline: the fewest Euler steps a chunk that would miss its playback
  deadline is given; 0: every chunk at full steps).

Examples::

    # the default grid: one knob at a time around the shipped defaults (~20 min on 2 cores)
    .venv/bin/python -m s3flow_tools.measure.batching

    # a product grid (every combination)
    .venv/bin/python -m s3flow_tools.measure.batching --grid max_queue_delay_us=2000,50000 solver_instances=1,2

    # one named setting per --setting, keys as above
    .venv/bin/python -m s3flow_tools.measure.batching --setting strategy=direct max_batch_size=4 \\
        --setting solver_instances=3

Bounded: at most ``--max-settings`` settings, and no new setting starts after ``--time-limit-s``. Writes the
tables (with the machine and the load) to ``results/sweep.md``; exits non-zero if a setting failed to load, ran
another setting than it names, or lost a stream.
"""
from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from s3flow.repository.settings import Batching, DEFAULT_INSTANCES
from s3flow.server.access import admin_headers
from s3flow.server.triton_server import TritonServer, TritonServerError
from s3flow_tools.bench.report import machine
from s3flow_tools.measure.command import command
from s3flow_tools.measure.layout import ENSEMBLES, build_trained, measure_server

ROOT = Path(__file__).resolve().parents[3]
INT_KNOBS = ("max_batch_size", "max_queue_delay_us", "max_candidate_sequences", "solver_instances",
             "estimator_instances", "encoder_instances", "ort_threads", "min_steps")
CHOICES = {"strategy": ("oldest", "direct"), "scheduling": ("fifo", "deadline")}
KNOBS = INT_KNOBS + tuple(CHOICES) + ("preferred_batch_sizes",)

#: One knob at a time around the shipped CPU defaults (2 solver instances, 2 estimator instances of one thread).
#: Not here: max_candidate_sequences below the number of streams, which failed on this server (2.51, oldest,
#: behind the ensemble): the candidates' chunks stalled until Triton's idle timeout, then "must specify the START
#: flag on the first request of the sequence" (results/sweep.md of 2026-11-30).
DEFAULT_SETTINGS = [
    {},
    {"solver_instances": 1, "estimator_instances": 1, "ort_threads": 0},
    {"solver_instances": 3},
    {"estimator_instances": 1, "ort_threads": 0},
    {"max_batch_size": 1},
    {"max_queue_delay_us": 0},
    {"max_queue_delay_us": 20000},
    {"preferred_batch_sizes": (4,)},
    {"strategy": "direct"},
    {"scheduling": "deadline"},
    {"scheduling": "deadline", "min_steps": 0},
]


def parse_value(key: str, text: str):
    if key not in KNOBS:
        raise argparse.ArgumentTypeError(f"unknown knob {key!r}; knobs: {', '.join(KNOBS)}")
    if key in CHOICES:
        if text not in CHOICES[key]:
            raise argparse.ArgumentTypeError(f"{key} must be one of {', '.join(CHOICES[key])}, got {text!r}")
        return text
    try:
        if key == "preferred_batch_sizes":
            return tuple(int(v) for v in text.split("+") if v)
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key} takes integers, got {text!r}") from None


def parse_pairs(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key] = value
    return out


def settings_from_args(args) -> list[dict]:
    if args.grid:
        axes = {k: [parse_value(k, v) for v in vs.split(",")] for k, vs in parse_pairs(args.grid).items()}
        return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]
    if args.setting:
        return [{k: parse_value(k, v) for k, v in parse_pairs(s).items()} for s in args.setting]
    return [dict(s) for s in DEFAULT_SETTINGS]


def build_flags(setting: dict) -> list[str]:
    """``scripts/build_repository.py``'s flags for ``setting``."""
    flags = []
    for key, value in setting.items():
        values = [str(v) for v in value] if isinstance(value, tuple) else [str(value)]
        flags += [f"--{key.replace('_', '-')}", *values]
    return flags


def served_differs(grpc_url: str, setting: dict) -> str:
    """What of ``setting``'s solver knobs the running server does not have ("" when all is)."""
    served = grpcclient.InferenceServerClient(grpc_url).get_model_config("cfm_solver", headers=admin_headers()).config
    seq = served.sequence_batching
    strategy = seq.WhichOneof("strategy_choice")
    got = {"max_batch_size": served.max_batch_size, "strategy": strategy,
           "max_queue_delay_us": getattr(seq, strategy).max_queue_delay_microseconds,
           "solver_instances": sum(g.count for g in served.instance_group)}
    return ", ".join(f"{k}={got[k]} (wanted {setting[k]})" for k in got if k in setting and got[k] != setting[k])


def describe(setting: dict) -> str:
    if not setting:
        return "defaults"
    return ", ".join(f"{k}={'+'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in setting.items())


def parse_args(argv=None):
    p = command(__file__, __doc__)
    g = p.add_argument_group("settings (default: one knob at a time around the shipped defaults)")
    g.add_argument("--grid", nargs="+", metavar="KNOB=V1,V2", help="every combination of these values")
    g.add_argument("--setting", nargs="+", action="append", metavar="KNOB=V", help="one setting (repeatable)")
    g.add_argument("--max-settings", type=int, default=12, help="(default: %(default)s)")
    g.add_argument("--time-limit-s", type=float, default=1800, help="start no setting after this (default: %(default)s)")
    ld = p.add_argument_group("load (the same for every setting)")
    ld.add_argument("--alone", type=int, default=2, help="streams alone per ensemble and server (default: %(default)s)")
    ld.add_argument("--at-once", type=int, default=16, help="streams that measure C (default: %(default)s)")
    ld.add_argument("--c-runs", type=int, default=3, help="C measurements per ensemble and setting (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "sweep.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    try:
        args.settings = settings_from_args(args)
        for s in args.settings:
            Batching(**{k: v for k, v in s.items() if k in Batching.__dataclass_fields__}).check()
            if s.get("min_steps", 0) < 0:
                raise ValueError(f"min_steps must be >= 0, got {s['min_steps']}")
    except (argparse.ArgumentTypeError, ValueError) as exc:
        p.error(str(exc))
    return args


def table(model: str, names: list[str], got: dict) -> list[str]:
    first = "first audio" if model == "token2wav" else "first mel"
    c0 = np.median(got[names[0]][model]["c"]) if got[names[0]][model]["c"] else float("nan")
    lines = [f"## {model}", "", f"| setting | C runs | C median | vs {names[0]} | spread (max / min) | "
             f"alone: {first} p50 (ms) |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name in names:
        f = got[name].get(model)
        if not f or not f["c"]:
            lines.append(f"| {name} | – | – | – | – | – |")
            continue
        c = np.median(f["c"])
        lines.append(f"| {name} | {' '.join(f'{v:.2f}' for v in f['c'])} | {c:.2f} | {c / c0:.2f} | "
                     f"{max(f['c']) / min(f['c']):.2f} | {1000 * np.median(f['first_s']):.0f} |")
    return lines + [""]


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM (a killed run) unwinds like Ctrl-C, so the servers' context managers stop them by PID
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = args.settings[:args.max_settings]
    names = [describe(s) for s in settings]
    got, failed, t0, started = {}, [], time.perf_counter(), time.strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory(prefix="s3flow-sweep-") as tmp:
        for k, (name, setting) in enumerate(zip(names, settings)):
            if time.perf_counter() - t0 > args.time_limit_s:
                failed.append(f"time limit reached: {len(settings) - k} settings not run")
                break
            repo = Path(tmp) / f"repo_{k}"
            build_trained(repo, build_flags(setting))
            try:
                with TritonServer(repo, log_file=Path(tmp) / f"server_{k}.log") as server:
                    wrong = served_differs(server.grpc_url, setting)
                    if wrong:   # the row would measure another setting than it names
                        raise TritonServerError(f"the server runs {wrong}")
                    got[name] = measure_server(server.grpc_url, args.alone, args.at_once, args.c_runs)
            except (TritonServerError, OSError, SystemExit) as exc:
                failed.append(f"{name}: {str(exc).splitlines()[0]}")
                got[name] = {}
                print(f"FAILED {failed[-1]}", flush=True)
                continue
            print(f"{name}: " + "; ".join(f"{m} C {' '.join(f'{c:.2f}' for c in f['c'])}"
                                          for m, f in got[name].items()), flush=True)
    m = machine()
    lines = [
        "# Server-side batching sweep", "",
        f"Written by `python -m s3flow_tools.measure.batching {' '.join(sys.argv[1:] if argv is None else argv)}` "
        f"on {started}.", "",
        f"- host: {', '.join(f'{k} {v}' for k, v in m.items())}; load average (1 min) at the end "
        f"{os.getloadavg()[0]:.2f}",
        "- model: the trained small teacher (10 guided steps) and its vocoder, admission off",
        f"- load per setting and ensemble: {args.alone} held-out sentences alone, then {args.c_runs} x "
        f"{args.at_once} held-out sentences at once, one client each (C: audio s per wall s)",
        "- defaults: " + ", ".join(f"{k}={v}" for k, v in DEFAULT_INSTANCES["cpu"].items())
        + ", ort_threads=0 (the cores divided among the estimator instances), strategy=oldest, max_batch_size=8, "
          "max_queue_delay_us=2000, scheduling=fifo", ""]
    for model in ENSEMBLES:
        lines += table(model, names, got)
    if failed:
        lines += [f"Failures: {'; '.join(failed)}", ""]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    if failed:
        print("FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
