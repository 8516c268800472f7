"""Server-side batching experiments: one table row per setting of a grid.

For each setting it writes the repository's configs again with the generator's own
``s3flow.repository.generator.write_flow_configs`` (the ONNX files are exported once), restarts tritonserver
(loopback only), drives the same fixed streaming load and prints one row: throughput (seconds of audio per
wall second), p50 / p99 chunk latency, p50 first-chunk latency, chunks per solver execute and errors. The
knobs are those of ``s3flow.repository.generator.Batching`` plus ``ort_threads``:

  strategy (oldest | direct), max_batch_size, preferred_batch_sizes (joined by '+', e.g. 4+8),
  max_queue_delay_us, max_candidate_sequences, solver_instances, estimator_instances, encoder_instances,
  length_bucket_ratio (0 = off, r >= 1: split a batch where a prefix is longer than r x the shortest),
  ort_threads (ONNX Runtime threads per estimator / encoder instance; 0 = all cores).

Examples::

    # the default grid: one knob at a time around the defaults, small model, 8 streams, best of 3 (~3-4 min)
    .venv/bin/python -m s3flow_tools.measure.batching

    # a product grid (every combination) on the full-size model, 4 staggered streams
    .venv/bin/python -m s3flow_tools.measure.batching --size full --streams 4 --stagger-s 1.0 \\
        --grid max_queue_delay_us=2000,50000 solver_instances=1,2

    # one named setting per --setting, keys as above
    .venv/bin/python -m s3flow_tools.measure.batching --setting strategy=direct max_batch_size=4 \\
        --setting length_bucket_ratio=1.5

Bounded: at most ``--max-settings`` settings, and no new setting starts after ``--time-limit-s``. Writes the
table (with the machine, the load and the model) to ``results/sweep.md``; exits non-zero if a setting
failed to load or lost an utterance.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parents[3]

from s3flow_tools.bench.report import fmt, log, machine, markdown, percentile
from s3flow_tools.bench.served import batching_load, run_load
from s3flow_tools.measure.command import command
from s3flow_contract.tensors import FRAMES_PER_SECOND
from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import random_flow
from s3flow.model.flow import FlowConfig
from s3flow.engine.settings import SolverSettings
from s3flow.repository.generator import write_flow_configs, write_repository
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow.server.access import admin_headers
from s3flow.server.triton_server import TritonServer, TritonServerError

KNOBS = [f.name for f in dataclasses.fields(Batching)] + ["ort_threads"]

#: One knob at a time around the defaults. Not here: max_candidate_sequences below the number of streams,
#: which failed on this server (2.51, oldest, behind the ensemble): with sequences in the backlog the
#: candidates' chunks stalled until Triton's idle timeout, then "must specify the START flag on the first
#: request of the sequence" (results/sweep.md).
DEFAULT_SETTINGS = [
    {},
    {"max_batch_size": 1},
    {"max_queue_delay_us": 0},
    {"max_queue_delay_us": 20000},
    {"preferred_batch_sizes": (4,)},
    {"strategy": "direct"},
    {"length_bucket_ratio": 1.5},
    {"solver_instances": 2},
    {"estimator_instances": 2, "ort_threads": 1},
]


def parse_value(key: str, text: str):
    if key not in KNOBS:
        raise argparse.ArgumentTypeError(f"unknown knob {key!r}; knobs: {', '.join(KNOBS)}")
    if key == "strategy":
        return text
    if key == "preferred_batch_sizes":
        return tuple(int(v) for v in text.split("+") if v)
    if key == "length_bucket_ratio":
        return float(text)
    return int(text)


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


def repository_settings(setting: dict, solver: SolverSettings) -> RepositorySettings:
    knobs = {k: v for k, v in setting.items() if k != "ort_threads"}
    batching = dataclasses.replace(Batching(), **knobs)
    if batching.strategy == "oldest":  # as write_repository requires: the solver refuses what Triton would queue
        solver = solver.replace(max_live_sequences=min(solver.sequences.max_live_sequences,
                                                       batching.max_candidate_sequences - 1))
    return RepositorySettings(solver=solver, batching=batching, ort_threads=setting.get("ort_threads", 0))


def served_differs(grpc_url: str, s: RepositorySettings) -> str:
    """What of the solver's batching the running server does not have as ``s`` says ("" when all is)."""
    served = grpcclient.InferenceServerClient(grpc_url).get_model_config("cfm_solver", headers=admin_headers()).config
    seq = served.sequence_batching
    strategy = seq.WhichOneof("strategy_choice")
    b = s.batching
    got = {"max_batch_size": served.max_batch_size, "strategy": strategy,
           "max_queue_delay_us": getattr(seq, strategy).max_queue_delay_microseconds,
           "solver_instances": sum(g.count for g in served.instance_group)}
    want = {"max_batch_size": b.max_batch_size, "strategy": b.strategy, "max_queue_delay_us": b.max_queue_delay_us,
            "solver_instances": b.solver_instances}
    return ", ".join(f"{k}={got[k]} (wanted {want[k]})" for k in want if got[k] != want[k])


def describe(setting: dict) -> str:
    if not setting:
        return "defaults"
    return ", ".join(f"{k}={'+'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in setting.items())


def parse_args(argv=None):
    p = command(__file__, __doc__)
    g = p.add_argument_group("settings (default: one knob at a time around the defaults)")
    g.add_argument("--grid", nargs="+", metavar="KNOB=V1,V2", help="every combination of these values")
    g.add_argument("--setting", nargs="+", action="append", metavar="KNOB=V", help="one setting (repeatable)")
    g.add_argument("--max-settings", type=int, default=12, help="(default: %(default)s)")
    g.add_argument("--time-limit-s", type=float, default=900, help="start no setting after this (default: %(default)s)")
    ld = p.add_argument_group("load (the same for every setting)")
    ld.add_argument("--streams", type=int, default=8, help="concurrent utterances (default: %(default)s)")
    ld.add_argument("--seconds", type=float, default=2.0, help="utterance length, +-20 %% (default: %(default)s)")
    ld.add_argument("--prompt-seconds", type=float, default=1.0, help="(default: %(default)s)")
    ld.add_argument("--steps", type=int, help="Euler steps (default: the model's: 10, meanflow 2)")
    ld.add_argument("--stagger-s", type=float, default=0.0,
                    help="start the streams this far apart, one client each (default: all at once, one stream)")
    ld.add_argument("--repeats", type=int, default=3,
                    help="run the load this many times per setting, report the run of best throughput "
                         "(default: %(default)s)")
    ld.add_argument("--load-timeout-s", type=float, default=600, help="(default: %(default)s)")
    m = p.add_argument_group("model")
    m.add_argument("--size", choices=["small", "full"], default="small", help="(default: %(default)s)")
    m.add_argument("--meanflow", action="store_true", help="random weights: a meanflow model")
    m.add_argument("--checkpoint", type=Path, help="an S3Gen checkpoint instead of random weights")
    m.add_argument("--workdir", type=Path, help="(default: a temporary folder)")
    m.add_argument("--out", type=Path, default=ROOT / "results" / "sweep.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    try:
        args.settings = settings_from_args(args)
        for s in args.settings:
            repository_settings(s, SolverSettings()).batching.check()
    except (argparse.ArgumentTypeError, ValueError) as exc:
        p.error(str(exc))
    return args


HEADER = ["setting", "audio s/s", "p50 chunk s", "p99 chunk s", "p50 first chunk s", "chunks per execute",
          "wall s", "errors"]


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM (a killed run) unwinds like Ctrl-C, so the servers' context managers stop them by PID
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="s3flow-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.checkpoint:
        flow = load_flow(args.checkpoint).eval()
    else:
        config = FlowConfig.full(args.meanflow) if args.size == "full" else FlowConfig.small(args.meanflow)
        flow = random_flow(config, seed=0).eval()
    n_feats, meanflow = flow.config.n_feats, flow.config.meanflow
    # the solver holds fewer live sequences than Triton's oldest batcher keeps candidates (256 by default)
    solver = SolverSettings.of(max_live_sequences=min(Batching().max_candidate_sequences - 1, max(8, 4 * args.streams)))
    repo = work / "repo"
    base = repository_settings({}, solver)
    write_repository(repo, flow, base)
    del flow
    utts = batching_load(args.streams, args.seconds, args.prompt_seconds, args.steps)
    audio = sum(2 * len(u.speech_tokens) for u in utts) / FRAMES_PER_SECOND
    settings = args.settings[:args.max_settings]
    log(f"{len(settings)} settings; load: {args.streams} streams of ~{args.seconds:g} s ({audio:.1f} s of audio), "
        f"{'stagger ' + str(args.stagger_s) + ' s' if args.stagger_s > 0 else 'all at once'}")
    rows, failed, t0 = [], [], time.perf_counter()
    for k, setting in enumerate(settings):
        if time.perf_counter() - t0 > args.time_limit_s:
            log(f"time limit reached: {len(settings) - k} settings not run")
            break
        name = describe(setting)
        wanted = repository_settings(setting, solver)
        write_flow_configs(repo, n_feats, meanflow, wanted)
        try:
            with TritonServer(repo, log_file=work / f"server_{k}.log") as server:
                wrong = served_differs(server.grpc_url, wanted)
                if wrong:  # the row would measure another setting than it names
                    raise TritonServerError(f"the server runs {wrong}")
                run_load(server.grpc_url, utts[:1], concurrent=False, timeout_s=args.load_timeout_s)  # warm-up
                runs = []
                for _ in range(max(args.repeats, 1)):
                    runs.append(run_load(server.grpc_url, utts, concurrent=True, server=server,
                                         stagger_s=args.stagger_s, timeout_s=args.load_timeout_s))
                    if runs[-1].errors:
                        break
                load = next((r for r in runs if r.errors), None) or max(runs, key=lambda r: r.audio_s / r.wall_s)
        except (TritonServerError, OSError) as exc:
            failed.append(f"{name}: server failed: {str(exc).splitlines()[0]}")
            rows.append([name] + ["–"] * 6 + ["server failed"])
            log(failed[-1])
            continue
        if load.errors:
            failed.append(f"{name}: {len(load.errors)} utterances failed: {load.errors[0]}")
        row = [name, f"{load.audio_s / load.wall_s:.2f}", fmt(percentile(load.latencies, 50)),
               fmt(percentile(load.latencies, 99)), fmt(percentile(load.first_chunks, 50)),
               f"{load.requests / max(load.executions, 1):.2f}", f"{load.wall_s:.1f}", str(len(load.errors))]
        rows.append(row)
        log(" | ".join(row))
    table = markdown(HEADER, rows)
    m = machine()
    model = f"checkpoint {args.checkpoint}" if args.checkpoint else f"{args.size} config, seeded random weights"
    text = "\n".join([
        "# Server-side batching sweep", "",
        f"Written by `python -m s3flow_tools.measure.batching` on {time.strftime('%Y-%m-%d %H:%M')}; command: "
        f"`python -m s3flow_tools.measure.batching {' '.join(sys.argv[1:] if argv is None else argv)}`.", "",
        f"- CPU: {m.get('cpu')}, {m.get('cores')} cores, {m.get('simd', '?')}; torch {m.get('torch')}, "
        f"onnxruntime {m.get('onnxruntime')}; load average (1 min) at the end {os.getloadavg()[0]:.2f}",
        f"- model: {model}, {'meanflow' if meanflow else 'regular'}; steps {args.steps or 'default'}",
        f"- load: {args.streams} streams of ~{args.seconds:g} s (+-20 %) after a {args.prompt_seconds:g} s prompt, "
        f"{audio:.1f} s of audio, chunks 10, x2, <= 100 tokens; best of {args.repeats} runs per setting; "
        + (f"one client per stream, started {args.stagger_s:g} s apart" if args.stagger_s > 0
           else "all at once over one gRPC stream"),
        "- defaults: " + ", ".join(f"{f.name}={getattr(Batching(), f.name)}" for f in dataclasses.fields(Batching))
        + ", ort_threads=0 (all cores)", "",
        table, ""] + ([f"Failures: {'; '.join(failed)}", ""] if failed else []))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(table)
    print(f"\n(written to {args.out})")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        print("FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
