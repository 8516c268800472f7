"""Cold start: the first utterance after a server start against the steady ones, warm-up off and on.

Builds one small seeded repository (the small flow config on seeded random weights, a small seeded HiFT
vocoder, ``token2wav``) twice, with ``RepositorySettings(warmup=False)`` and ``warmup=True`` (``s3flow.serving.warmup``:
Triton ``model_warmup`` for ``flow_encoder`` and ``estimator``, a warm-up at load inside ``cfm_solver`` and
``vocoder``). For each, ``--starts`` times: start tritonserver on 127.0.0.1, stream the same utterance
``--utterances`` times one after the other through ``--model``, stop. Per start, the first utterance's
chunk latencies are compared with the median of the later utterances' (same chunks, same server). Also
per model, from Triton's statistics: model executions counted before the first request (warm-up runs)
and the mean compute time of the first utterance's executions against the later ones'.

Writes a markdown report (``--output``, default ``results/warmup.md``) and exits non-zero when, with
warm-up on, a first chunk is above ``--bound`` (1.5) x its steady latency in the median over the starts.

Example (from the repository root; about 2 minutes on 2 cores)::

    .venv/bin/python -m s3flow_tools.measure.warmup
    .venv/bin/python -m s3flow_tools.measure.warmup --starts 1 --utterances 5 --output /tmp/warmup.md
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]

from s3flow_tools.bench.repos import warmup_repository
from s3flow_tools.bench.served import model_stats

MODELS = ("flow_encoder", "estimator", "cfm_solver", "vocoder")


def per_execution_ms(a: dict, b: dict, model: str) -> float:
    runs = b[model][0] - a[model][0]
    return (b[model][1] - a[model][1]) / runs / 1e6 if runs else float("nan")


def one_start(repo: Path, model: str, utterances: int, seconds: float, steps: int, log_dir: Path) -> dict:
    from s3flow.server.triton_server import TritonServer
    from s3flow_client import StreamingClient
    from s3flow_client.demo import demo_utterance

    utt = demo_utterance(seconds, seed=7, prompt_seconds=1.0)
    utt.chunks, utt.n_timesteps = [10, 20, len(utt.speech_tokens) - 30], steps
    t0 = time.monotonic()
    with TritonServer(repo, log_file=log_dir / f"server_{time.time_ns()}.log") as server:
        ready_s = time.monotonic() - t0
        client = server.client()
        stats = [model_stats(client)]
        runs = []
        for _ in range(utterances):
            [res] = StreamingClient(server.grpc_url, model=model, timeout_s=120).synthesize([utt])
            runs.append(res.chunk_latencies_s)
            stats.append(model_stats(client))
    first = np.array(runs[0])
    steady = np.median(np.array(runs[1:]), axis=0)
    return {"ready_s": ready_s, "first": first, "steady": steady,
            "warm_runs": {m: stats[0][m][0] for m in MODELS if m in stats[0]},
            "model_first_ms": {m: per_execution_ms(stats[0], stats[1], m) for m in MODELS if m in stats[0]},
            "model_steady_ms": {m: per_execution_ms(stats[1], stats[-1], m) for m in MODELS if m in stats[0]}}


def report(results: dict, args, machine: str) -> tuple[str, bool]:
    lines = ["# Cold start: first utterance vs steady, warm-up off and on", "",
             f"`python -m s3flow_tools.measure.warmup --starts {args.starts} --utterances {args.utterances} "
             f"--seconds {args.seconds} --steps {args.steps} --model {args.model}`; {machine}.", "",
             "Small flow config on seeded random weights, small seeded HiFT; one utterance of "
             f"{args.seconds} s in chunks of 10, 20 and the rest tokens, {args.steps} guided Euler steps, "
             "streamed again and again after each server start. *first*: the first utterance after the start; "
             "*steady*: the median of the later ones on the same server. Medians over the starts.", "",
             "| warm-up | server ready s | chunk 1 first / steady ms | ratio | chunk 2 ratio | chunk 3 ratio | "
             "utterance first / steady ms | ratio |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ok = True
    for name, starts in results.items():
        ratios = np.median(np.array([s["first"] / s["steady"] for s in starts]), axis=0)
        first = np.median(np.array([s["first"] for s in starts]), axis=0) * 1e3
        steady = np.median(np.array([s["steady"] for s in starts]), axis=0) * 1e3
        total = float(np.median([s["first"].sum() / s["steady"].sum() for s in starts]))
        ready = statistics.median(s["ready_s"] for s in starts)
        lines.append(f"| {name} | {ready:.1f} | {first[0]:.0f} / {steady[0]:.0f} | {ratios[0]:.2f} | "
                     f"{ratios[1]:.2f} | {ratios[2]:.2f} | {first.sum():.0f} / {steady.sum():.0f} | {total:.2f} |")
        if name == "on" and (ratios > args.bound).any():
            ok = False
    lines += ["", "Per model (Triton statistics): executions before the first request (warm-up runs), and "
              "compute ms per execution, first utterance / steady (median over starts):", "",
              "| warm-up | " + " | ".join(MODELS) + " |", "| --- |" + " ---: |" * len(MODELS)]
    for name, starts in results.items():
        cells = []
        for m in MODELS:
            warm = statistics.median(s["warm_runs"].get(m, 0) for s in starts)
            f = statistics.median(s["model_first_ms"].get(m, float("nan")) for s in starts)
            st = statistics.median(s["model_steady_ms"].get(m, float("nan")) for s in starts)
            cells.append(f"{warm:.0f} runs; {f:.1f} / {st:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Bound: with warm-up on, every chunk of the first utterance within {args.bound}x its steady "
              f"latency (median over starts): {'met' if ok else 'NOT met'}."]
    return "\n".join(lines) + "\n", ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m s3flow_tools.measure.warmup", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--starts", type=int, default=3, help="server starts per variant")
    p.add_argument("--utterances", type=int, default=6, help="utterances per start (the first is the cold one)")
    p.add_argument("--seconds", type=float, default=3.0, help="utterance length")
    p.add_argument("--steps", type=int, default=4, help="Euler steps per chunk")
    p.add_argument("--model", default="token2wav", choices=["token2wav", "token2mel"])
    p.add_argument("--bound", type=float, default=1.5, help="largest first/steady ratio allowed with warm-up")
    p.add_argument("--variants", default="off,on", help="which of off,on to run")
    p.add_argument("--output", type=Path, default=ROOT / "results" / "warmup.md")
    args = p.parse_args(argv)
    if args.utterances < 2 or args.starts < 1:
        p.error("need --utterances >= 2 and --starts >= 1")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    results = {}
    with tempfile.TemporaryDirectory(prefix="s3flow-warmup-") as tmp:
        for name in args.variants.split(","):
            repo = warmup_repository(Path(tmp) / name, warmup=name == "on")
            results[name] = []
            for k in range(args.starts):
                r = one_start(repo, args.model, args.utterances, args.seconds, args.steps, Path(tmp))
                print(f"warm-up {name}, start {k + 1}: ready {r['ready_s']:.1f} s, first "
                      f"{np.round(r['first'] * 1e3).tolist()} ms, steady {np.round(r['steady'] * 1e3).tolist()} ms, "
                      f"warm-up runs {r['warm_runs']}", flush=True)
                results[name].append(r)
    text, ok = report(results, args, machine)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    return 0 if ok or "on" not in results else 1


if __name__ == "__main__":
    sys.exit(main())
