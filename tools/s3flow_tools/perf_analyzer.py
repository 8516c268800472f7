"""Triton's perf_analyzer, installed into the project and run against the ensembles.

perf_analyzer is a C++ program of the Triton SDK (the ``-py3-sdk`` image). Outside that image it comes inside
the ``tritonclient`` 2.41.1 manylinux wheel on PyPI (``tritonclient-2.41.1.data/data/bin/perf_analyzer``; later
wheels no longer carry it). It links two libraries the wheel does not hold: ``libb64.so.0d`` (Debian's
``libb64-0d``, installed by ``make perf-analyzer``) and ``libcudart.so.12`` (the ``nvidia-cuda-runtime-cu12``
wheel's; it loads without a GPU). :func:`install` downloads both wheels (``pip download``, no dependencies,
nothing installed into any environment), takes the binary and the CUDA runtime out of them into ``.tools/
perf_analyzer/`` (git-ignored) and writes ``bin/perf_analyzer``, a wrapper that finds its library there.

:func:`command` is the command line docs/operations.md shows, with the flags that settle on this kind of load:
each stream is one utterance whose chunks differ about 4x in size (the client's growing schedule), so a window's
latency percentile never settles; the stability check runs on the average (no ``--percentile``), within 60 %
over 3 windows (``--stability-percentage 60``, ``--max-trials 15``), and a window is a count of requests
(``--measurement-mode count_windows``: a few whole utterances per window, whatever their speed) rather than a
time. :func:`run` runs it and reads its CSV (``-f``).

Example::

    .venv/bin/python -m s3flow_tools.perf_analyzer install
    .venv/bin/python -m s3flow_tools.perf_analyzer run --url 127.0.0.1:8001 --model token2mel \\
        --input-data out/perf_inputs.json --concurrency 1 2 4
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".tools" / "perf_analyzer"
#: the wheels the binary and its CUDA runtime come from (pinned: 2.41.1 is the last release that bundles it)
WHEELS = {"tritonclient": "2.41.1", "nvidia-cuda-runtime-cu12": "12.3.101"}
MEMBERS = {"tritonclient": ("tritonclient-2.41.1.data/data/bin/perf_analyzer", "libexec/perf_analyzer"),
           "nvidia-cuda-runtime-cu12": ("nvidia/cuda_runtime/lib/libcudart.so.12", "lib/libcudart.so.12")}
WRAPPER = """#!/bin/sh
# perf_analyzer from the tritonclient 2.41.1 wheel, with the CUDA runtime it links (s3flow_tools.perf_analyzer)
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/../libexec/perf_analyzer" "$@"
"""
#: requests per measurement window, as utterances of ``sequence_length`` requests each
WINDOW_UTTERANCES = 4


def binary(home: Path = HOME) -> Path:
    return home / "bin" / "perf_analyzer"


def version(home: Path = HOME) -> Optional[str]:
    """What the installed binary says of itself (None: not installed, or it does not start)."""
    try:
        out = subprocess.run([str(binary(home)), "--version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    said = (out.stdout + out.stderr).strip()   # it prints its version on stderr
    return said if out.returncode == 0 and said.startswith("Perf Analyzer") else None


def install(home: Path = HOME, python: str = sys.executable) -> str:
    """perf_analyzer and its CUDA runtime into ``home`` (nothing done if it already runs); its version line."""
    found = version(home)
    if found:
        return found
    with tempfile.TemporaryDirectory() as tmp:
        specs = [f"{name}=={v}" for name, v in WHEELS.items()]
        subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux1_x86_64", "--python-version", "3.11", "-d", tmp, *specs],
                       check=True)
        for name, (member, target) in MEMBERS.items():
            [wheel] = [p for p in Path(tmp).iterdir() if p.name.startswith(name.replace("-", "_") + "-")]
            dest = home / target
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(wheel) as z:
                dest.write_bytes(z.read(member))
            dest.chmod(0o755)
    binary(home).parent.mkdir(parents=True, exist_ok=True)
    binary(home).write_text(WRAPPER)
    binary(home).chmod(0o755)
    found = version(home)
    if not found:
        out = subprocess.run([str(binary(home)), "--version"], capture_output=True, text=True)
        raise RuntimeError(f"perf_analyzer does not start: {out.stderr.strip() or out.stdout.strip()} "
                           "(libb64.so.0d: apt-get install libb64-0d)")
    return found


def command(url: str, model: str, input_data: Path, concurrency: int, sequence_length: int, csv_path: Path,
            first_sequence_id: int = 1_000_000, window_requests: Optional[int] = None,
            home: Path = HOME) -> list[str]:
    """The perf_analyzer command line for ``model`` over gRPC streaming at one ``concurrency`` (utterances in
    flight; module docstring for the flags); a window of ``window_requests`` (default: ``WINDOW_UTTERANCES``
    utterances per stream in flight)."""
    window = window_requests or WINDOW_UTTERANCES * sequence_length * concurrency
    return [str(binary(home)), "-m", model, "-u", url, "-i", "grpc", "--streaming",
            "--input-data", str(input_data), "--sequence-length", str(sequence_length),
            "--sequence-length-variation", "0",
            "--sequence-id-range", f"{first_sequence_id}:{first_sequence_id + 100_000}",
            "--concurrency-range", str(concurrency),
            "--measurement-mode", "count_windows", "--measurement-request-count", str(window),
            "--stability-percentage", "60", "--max-trials", "15", "-f", str(csv_path)]


@dataclass
class Level:
    """One concurrency of a perf_analyzer run, from its CSV: requests per second and the median client-side
    latency of one request (a chunk), in ms."""
    concurrency: int
    per_s: float
    latency_ms: float


@dataclass
class Run:
    """perf_analyzer at each concurrency asked: exit codes, what it printed, the CSV rows."""
    returncodes: list
    output: str
    levels: list

    @property
    def ok(self) -> bool:
        return bool(self.returncodes) and not any(self.returncodes) and len(self.levels) == len(self.returncodes)


def read_csv(path: Path) -> list[Level]:
    """perf_analyzer's ``-f`` CSV: one row per concurrency (latencies in microseconds; p50 to p99, no average
    in a streaming run)."""
    if not path.exists():
        return []
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return [Level(int(r["Concurrency"]), float(r["Inferences/Second"]), float(r["p50 latency"]) / 1000.0)
            for r in rows]


def run(url: str, model: str, input_data: Path, concurrency: Sequence[int], sequence_length: int,
        first_sequence_id: int = 1_000_000, window_requests: Optional[int] = None, timeout_s: float = 600.0,
        home: Path = HOME) -> Run:
    """perf_analyzer once per ``concurrency``, each on sequence ids of its own."""
    res = Run([], "", [])
    with tempfile.TemporaryDirectory() as tmp:
        for k, n in enumerate(concurrency):
            path = Path(tmp) / f"perf_{n}.csv"
            argv = command(url, model, input_data, n, sequence_length, path, first_sequence_id + k * 100_000,
                           window_requests, home)
            out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                                 env={**os.environ, "LC_ALL": "C"})
            res.returncodes.append(out.returncode)
            res.output += out.stdout + out.stderr
            res.levels += read_csv(path)
    return res


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m s3flow_tools.perf_analyzer", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("install", help=f"download and unpack perf_analyzer into {HOME.relative_to(ROOT)}/")
    r = sub.add_parser("run", help="run it against a server and print its CSV's figures")
    r.add_argument("--url", default="127.0.0.1:8001")
    r.add_argument("--model", default="token2mel")
    r.add_argument("--input-data", type=Path, required=True, help="scripts/perf_inputs.py's file")
    r.add_argument("--sequence-length", type=int, default=4)
    r.add_argument("--concurrency", type=int, nargs="+", default=[1])
    args = p.parse_args(argv)
    if args.what == "install":
        print(install())
        return 0
    res = run(args.url, args.model, args.input_data, args.concurrency, args.sequence_length)
    print(res.output)
    for level in res.levels:
        print(f"concurrency {level.concurrency}: {level.per_s:.2f} requests/s, {level.latency_ms:.0f} ms p50")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
