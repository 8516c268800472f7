"""perf_analyzer against the project's own replay, measured (issue 42): results/perf_analyzer.md.

Both ensembles, fifo and deadline scheduling, each at concurrency 1, 2, 4 and 8 on one server per scheduling
(the trained small teacher, admission off: perf_analyzer sends each chunk as soon as the last is answered, not at
real time). perf_analyzer (``s3flow_tools.perf_analyzer``: count windows, the average's stability) and
``scripts/perf_inputs.py``'s replay (plain tritonclient, the same file, the same gRPC streaming sequence pattern)
run one after the other on the same server and inputs; the table puts their requests per second side by side.

    .venv/bin/python -m s3flow_tools.measure.perf_analyzer            # about 15 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from s3flow.repository import cli as build_repository
from s3flow.server.triton_server import TritonServer
from s3flow_tools import perf_analyzer
from s3flow_tools.bench.report import machine
from s3flow_tools.measure.corpus import TRAINED

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import perf_inputs  # noqa: E402

STEPS = 4
MODES = {"fifo": ["--scheduling", "fifo"], "deadline": ["--scheduling", "deadline"]}


def build(repo: Path, mode: str) -> None:
    if build_repository.main(["--checkpoint", str(TRAINED / "teacher.safetensors"), "--vocoder-checkpoint",
                              str(TRAINED / "vocoder.safetensors"), "--output", str(repo), "--no-voice",
                              "--utilization-target", "0", *MODES[mode]]) != 0:
        raise SystemExit("building the repository failed")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m s3flow_tools.measure.perf_analyzer", description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--models", nargs="+", default=["token2mel", "token2wav"])
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--window-utterances", type=int, default=2, help="utterances per stream in flight per window")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "perf_analyzer.md")
    args = p.parse_args(argv)
    if not perf_analyzer.version():
        raise SystemExit("perf_analyzer is not installed: make perf-analyzer")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "perf_inputs.json"
        if perf_inputs.main(["--sequence-length", str(STEPS), "--output", str(data)]) != 0:
            raise SystemExit("writing the input data failed")
        doc = json.loads(data.read_text())
        sid = 1_000_000
        for mode in args.modes:
            build(tmp / mode, mode)
            with TritonServer(tmp / mode, log_file=tmp / f"{mode}.log") as server:
                for model in args.models:
                    perf_inputs.replay({"data": doc["data"][:2]}, server.grpc_url, model, 2, sid)   # warm
                    sid += 10
                    for n in args.concurrency:
                        # the same utterances for both: perf_analyzer cycles through them, the replay plays each once
                        streams = {"data": doc["data"][:max(4 * n, 8)]}
                        subset = tmp / f"perf_inputs_{len(streams['data'])}.json"
                        subset.write_text(json.dumps(streams))
                        pa = perf_analyzer.run(server.grpc_url, model, subset, [n], STEPS, first_sequence_id=sid,
                                               window_requests=args.window_utterances * STEPS * n)
                        sid += 200_000
                        rp = perf_inputs.replay(streams, server.grpc_url, model, n, sid)
                        sid += 1_000
                        ok = pa.ok and rp.ok
                        pa_rate = pa.levels[0].per_s if pa.levels else float("nan")
                        pa_ms = pa.levels[0].latency_ms if pa.levels else float("nan")
                        rp_rate = rp.requests / rp.wall_s
                        rows.append((model, mode, n, pa_rate, pa_ms, rp_rate, ok))
                        print(f"{model} {mode} concurrency {n}: perf_analyzer {pa_rate:.2f}/s ({pa_ms:.0f} ms), "
                              f"replay {rp_rate:.2f}/s, ratio {pa_rate / rp_rate:.2f}" +
                              ("" if ok else f"  FAILED: {pa.output[-500:]} {rp.errors[:2]}"), flush=True)
    within = sum(abs(r[3] / r[5] - 1) <= 0.15 for r in rows if r[6])
    lines = ["# perf_analyzer against the project's replay", "",
             f"Made by `python -m s3flow_tools.measure.perf_analyzer` on "
             f"{', '.join(f'{k} {v}' for k, v in machine().items())}: the trained small teacher (10 guided steps), "
             f"admission off, one server per scheduling, the same input file (`scripts/perf_inputs.py`: the 64 "
             f"held-out sentences, {STEPS} requests each; at concurrency N both play the first max(4N, 8) of them). "
             f"perf_analyzer: docs/operations.md's command "
             f"(gRPC streaming, `--measurement-mode count_windows`, `--stability-percentage 60 --max-trials 15`) "
             f"with a window of {args.window_utterances} utterances per stream in flight; the replay: "
             f"`scripts/perf_inputs.py --replay` at the same concurrency, each utterance once, right after it on "
             f"the same server. Requests are chunks; perf_analyzer's latency is its "
             f"median over the stable windows.", "",
             f"**{within} of {len(rows)}** rows within 15 % of each other.", "",
             "| ensemble | scheduling | concurrency | perf_analyzer requests/s | perf_analyzer latency p50 (ms) | "
             "replay requests/s | perf_analyzer / replay | every request answered |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for model, mode, n, pa_rate, pa_ms, rp_rate, ok in rows:
        lines.append(f"| {model} | {mode} | {n} | {pa_rate:.2f} | {pa_ms:.0f} | {rp_rate:.2f} | "
                     f"{pa_rate / rp_rate:.2f} | {'yes' if ok else 'no'} |")
    lines += ["", "What perf_analyzer cannot tell here: the first audio of an utterance and whether streams stay "
                  "ahead of real-time playback (it sends each chunk as soon as the last is answered); "
                  "`scripts/load_test.py` and `python -m s3flow_tools.measure.qos` measure those.", ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
