"""Which layout of model instances carries the most streams on this host: C and a stream alone, per layout.

A layout is the instance counts and threads that ``scripts/build_repository.py`` takes (``--solver-instances``,
``--estimator-instances``, ``--ort-threads``). For each layout in turn (``--rounds`` passes over the list, so that
the host's drift falls on every layout alike) it builds the repository of the trained small teacher with its
vocoder (``checkpoints/trained``; admission off, so that every stream offered is served; the voice encoder off),
starts one server, and for ``token2mel`` and ``token2wav``:

* a stream alone: ``--alone`` held-out sentences one after the other (first mel, or first audio on token2wav);
* C: ``--at-once`` held-out sentences started together, one client each, ``--c-runs`` times (seconds of audio
  per second of wall time).

Example::

    .venv/bin/python -m s3flow_tools.measure.layout                      # -> results/layout.md
    .venv/bin/python -m s3flow_tools.measure.layout --layouts 1,1,0 2,2,1 --rounds 1 --c-runs 1 --out /tmp/l.md

Exits non-zero when a stream fails.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from s3flow_contract.tensors import FRAMES_PER_SECOND
from s3flow.repository import cli as build_repository
from s3flow.server.triton_server import TritonServer
from s3flow_tools.bench.report import machine
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import TRAINED, utterances
from s3flow_tools.measure.qos import streams

ROOT = Path(__file__).resolve().parents[3]
ENSEMBLES = ("token2mel", "token2wav")
#: solver instances, estimator instances, ONNX Runtime threads per instance (0: the cores divided among them)
DEFAULT_LAYOUTS = ("1,1,0", "1,2,1", "2,1,0", "2,2,1", "3,2,1")
#: seconds a new server is left alone before the first stream (the solver instances calibrate at load)
SETTLE_S = 5.0


def layout_flags(layout: str) -> list[str]:
    solvers, estimators, threads = (int(v) for v in layout.split(","))
    return ["--solver-instances", str(solvers), "--estimator-instances", str(estimators),
            "--ort-threads", str(threads)]


def describe(layout: str) -> str:
    solvers, estimators, threads = (int(v) for v in layout.split(","))
    return (f"{solvers} solver{'s' * (solvers > 1)}, {estimators} estimator{'s' * (estimators > 1)}, "
            f"{'threads: cores / instances' if threads == 0 else f'{threads} thread' + 's' * (threads > 1)}")


def build_trained(repo: Path, flags: list[str]) -> None:
    """The repository of the trained small teacher and its vocoder as the measurements here serve it (admission
    off, so that every stream offered is served; no voice encoder), with ``flags`` of ``build_repository``."""
    if build_repository.main(["--checkpoint", str(TRAINED / "teacher.safetensors"), "--vocoder-checkpoint",
                              str(TRAINED / "vocoder.safetensors"), "--output", str(repo), "--no-voice",
                              "--no-admission", "--no-check", *flags]) != 0:
        raise SystemExit(f"building the repository with {' '.join(flags) or 'the defaults'} failed")


def measure_server(url: str, alone: int, at_once: int, c_runs: int) -> dict:
    """Per ensemble: first answer of a stream alone (s) and C (s of audio per s), from one running server."""
    out = {}
    time.sleep(SETTLE_S)   # every solver instance's calibration at load (its calls would share the cores)
    for model in ENSEMBLES:
        streams(url, model, utterances(2), 0.0)   # warm this ensemble's path
        firsts, cs = [], []
        for k in range(alone):
            [r], _ = streams(url, model, utterances(1, offset=k), 0.0)
            if r.error is not None:
                raise SystemExit(f"{model}: a stream alone failed: {r.error}")
            firsts.append(r.first_audio_s if model == "token2wav" else r.first_chunk_s)
        for _ in range(c_runs):
            results, wall = streams(url, model, utterances(at_once), 0.0)
            bad = [r.error for r in results if r.error is not None]
            if bad:
                raise SystemExit(f"{model}: {len(bad)} of {at_once} streams failed at saturation: {bad[0]}")
            cs.append(sum(r.mel.shape[1] for r in results) / FRAMES_PER_SECOND / wall)
        out[model] = {"first_s": firsts, "c": cs}
    return out


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS), metavar="S,E,T",
                   help="solver instances, estimator instances, ONNX Runtime threads (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="passes over the layouts (default: %(default)s)")
    p.add_argument("--alone", type=int, default=3, help="streams alone per ensemble and server (default: %(default)s)")
    p.add_argument("--at-once", type=int, default=16, help="streams that measure C (default: %(default)s)")
    p.add_argument("--c-runs", type=int, default=3, help="C measurements per ensemble and server (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "layout.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    for layout in args.layouts:
        try:
            layout_flags(layout)
        except ValueError:
            p.error(f"--layouts: expected S,E,T (three integers), got {layout!r}")
    got = {layout: {m: {"first_s": [], "c": []} for m in ENSEMBLES} for layout in args.layouts}
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for layout in args.layouts:
                repo = Path(tmp) / f"repo_{layout.replace(',', '_')}"
                if not repo.exists():
                    build_trained(repo, layout_flags(layout))
                with TritonServer(repo, log_file=Path(tmp) / f"server_{layout}_{rnd}.log") as server:
                    figures = measure_server(server.grpc_url, args.alone, args.at_once, args.c_runs)
                for model, f in figures.items():
                    for key, values in f.items():
                        got[layout][model][key].extend(values)
                print(f"round {rnd + 1}, {describe(layout)}: " + "; ".join(
                    f"{m} C {' '.join(f'{c:.2f}' for c in f['c'])}, first {1000 * np.median(f['first_s']):.0f} ms"
                    for m, f in figures.items()), flush=True)
    base = args.layouts[0]
    lines = ["# Layouts of model instances on this host", "",
             f"Made by `python -m s3flow_tools.measure.layout {' '.join(sys.argv[1:] if argv is None else argv)}` "
             f"on {time.strftime('%Y-%m-%d %H:%M', time.localtime(t_start))}, "
             f"{', '.join(f'{k} {v}' for k, v in machine().items())}: the trained small teacher (10 guided steps) "
             f"and its vocoder, admission off, fifo; {args.rounds} server(s) per layout, layouts in turn; per "
             f"server and ensemble {args.alone} held-out sentences alone, then {args.c_runs} x {args.at_once} at "
             f"once (C). Ratios against the first layout.", ""]
    for model in ENSEMBLES:
        first = "first audio" if model == "token2wav" else "first mel"
        lines += [f"## {model}", "",
                  f"| layout (solvers, estimators, threads) | C runs | C median | C vs {describe(base)} | "
                  f"alone: {first} p50 (ms) |", "| --- | --- | ---: | ---: | ---: |"]
        c0 = np.median(got[base][model]["c"])
        for layout in args.layouts:
            f = got[layout][model]
            lines.append(f"| {describe(layout)} | {' '.join(f'{c:.2f}' for c in f['c'])} | {np.median(f['c']):.2f} | "
                         f"{np.median(f['c']) / c0:.2f} | {1000 * np.median(f['first_s']):.0f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
