"""Streaming modes measured on the trained small model; writes results/streaming.md.

Examples::

    .venv/bin/python -m s3flow_tools.measure.streaming                      # about 10 minutes on 2 cores
    .venv/bin/python -m s3flow_tools.measure.streaming --lengths 10 --contexts 50 --out /tmp/streaming.md

For offline synthesis, the prefix re-run and bounded context with each ``--contexts`` value C (frames),
on held-out utterances (``checkpoints/trained/heldout.npz``) and on 10 / 30 / 60 s utterances made by
joining held-out sentences of one voice, with the client's default chunk schedule (10 tokens, growing
x2 to 100), the guided 10-step teacher, in process (the served chunk logic, torch estimator):

* cost: estimator frames x NFE and wall time, relative to offline synthesis of the same utterance;
* latency of the first, middle and last chunk, and last / first same-size chunk;
* mel error against the ground truth, relative to offline's, beside offline's seed-to-seed spread;
* seam roughness: frame-to-frame change at chunk seams over the same away from seams (1.0 = invisible).

Exits non-zero if a stream loses or duplicates a frame (``measure`` asserts the shape).
"""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]

from s3flow_contract.tensors import FRAMES_PER_SECOND, TOKENS_PER_SECOND
from s3flow.model.checkpoint import load_flow
from s3flow_training.evaluate import synthesize_one
from s3flow_training.package import load_heldout
from s3flow_training.streaming_eval import long_utterances, measure
from s3flow_client import chunk_schedule
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import TRAINED



def mode_name(c) -> str:
    return "offline" if c is None else ("prefix re-run" if c < 0 else f"bounded, C = {c}")


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--checkpoint", type=Path, default=TRAINED / "teacher.safetensors", help="(default: %(default)s)")
    p.add_argument("--heldout", type=Path, default=TRAINED / "heldout.npz", help="(default: %(default)s)")
    p.add_argument("--contexts", type=int, nargs="+", default=[0, 50, 100, 200],
                   help="bounded-context sizes in frames (default: %(default)s)")
    p.add_argument("--lengths", type=float, nargs="*", default=[10.0, 30.0, 60.0],
                   help="joined utterance lengths in seconds (default: %(default)s)")
    p.add_argument("--max-heldout", type=int, default=8, help="single held-out sentences (default: %(default)s)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="(default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "streaming.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    flow = load_flow(args.checkpoint)
    heldout = load_heldout(args.heldout)
    sets = [("held-out sentences", heldout[:args.max_heldout])]
    sets += [(f"{s:g} s joined", [u]) for s, u in zip(args.lengths, long_utterances(heldout, args.lengths))]
    modes = [None, -1] + list(args.contexts)

    lines = [
        "# Streaming modes on the trained small model",
        "",
        f"Written by `python -m s3flow_tools.measure.streaming` ({time.strftime('%Y-%m-%d')}); checkpoint "
        f"`{args.checkpoint.name}`, guided 10 steps (w = 0.7), client chunk schedule (10 tokens, x2, up to 100), "
        f"in process (the served chunk logic, torch estimator, {args.threads} threads, "
        f"{platform.processor() or platform.machine()}).",
        "",
        "Cost = estimator frames x NFE, summed over chunks; ratios are against offline synthesis of the same "
        "utterance. Latency: first / middle / last chunk in ms; `last/first` compares the last full-size "
        "(100-token) chunk with the first one. Error: mean |mel - ground truth| (log-mel), and its ratio to "
        "offline's. Seam roughness: frame-to-frame change at seams / elsewhere (1.0 = invisible).",
        "",
    ]
    summary = {}
    for set_name, utts in sets:
        spread = []
        for u in utts:  # offline seed-to-seed spread: the natural scale of differences
            a, _ = synthesize_one(flow, u, 10, 0.7, seed=0)
            b, _ = synthesize_one(flow, u, 10, 0.7, seed=1)
            spread.append(float(np.abs(a - b).mean()))
        secs = sum(u.frames for u in utts) / FRAMES_PER_SECOND
        lines += [f"## {set_name}: {len(utts)} utterance(s), {secs:.1f} s of speech", "",
                  f"Offline seed-to-seed spread (mean |seed 0 - seed 1|): {np.mean(spread):.3f}.", "",
                  "| mode | cost (frames x NFE) | cost / offline | wall s | wall / offline | chunk ms first / middle / last "
                  "| last/first 100-token | error vs truth | / offline | seam roughness |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        base = None
        for c in modes:
            rows = []
            for k, u in enumerate(utts):
                chunks = chunk_schedule(len(u.speech_tokens), 10, 2.0, 100)
                rows.append(measure(flow, u, chunks, c, seed=0))
                print(f"[{time.perf_counter() - t_start:6.0f} s] {set_name} #{k}: {mode_name(c)}: "
                      f"cost {rows[-1].cost_frames}, wall {rows[-1].wall_s:.2f} s, error {rows[-1].mae_gt:.3f}, "
                      f"roughness {rows[-1].seam_roughness:.2f}", flush=True)
            cost = sum(r.cost_frames for r in rows)
            wall = sum(r.wall_s for r in rows)
            err = float(np.mean([r.mae_gt for r in rows]))
            rough = [r.seam_roughness for r in rows if np.isfinite(r.seam_roughness)]
            if base is None:
                base = (cost, wall, err)
            lat = rows[-1].chunk_latency_s
            sizes = rows[-1].chunk_tokens
            full = [t for t, n in zip(lat[:-1], sizes[:-1]) if n == 100]
            lat_txt = "-" if c is None else " / ".join(f"{x * 1000:.0f}" for x in (lat[0], lat[len(lat) // 2], lat[-1]))
            ratio_txt = f"{full[-1] / full[0]:.2f}" if len(full) >= 2 else "-"
            lines.append(f"| {mode_name(c)} | {cost} | {cost / base[0]:.2f} | {wall:.2f} | {wall / base[1]:.2f} | "
                         f"{lat_txt} | {ratio_txt} | {err:.3f} | {err / base[2]:.3f} | "
                         f"{np.mean(rough):.2f} |" if rough else
                         f"| {mode_name(c)} | {cost} | {cost / base[0]:.2f} | {wall:.2f} | {wall / base[1]:.2f} | "
                         f"{lat_txt} | {ratio_txt} | {err:.3f} | {err / base[2]:.3f} | - |")
            summary[(set_name, c)] = (cost / base[0], wall / base[1], err / base[2],
                                      np.mean(rough) if rough else float("nan"),
                                      full[-1] / full[0] if len(full) >= 2 else float("nan"))
        lines.append("")
    # full size: estimator FLOPs of every solve the engine plans (no run: 60 s at full size is hours on 2 cores)
    from s3flow.model.estimator import EstimatorConfig
    from s3flow.model.flops import estimator_flops, solve_flops
    from s3flow.engine.planning import planned_calls
    full = EstimatorConfig.full()
    lines += ["## Full size (71 M estimator, guided 10 steps): estimator cost", "",
              "GFLOP of every estimator call the engine plans for one utterance with a 2 s (50-token) prompt, "
              "counted from the config (`s3flow.model.flops`) over a dry run of the real `StreamingEngine` with stand-in "
              "models: the cost figures only (served wall time at this size is hours for a 60 s prefix re-run on "
              "2 cores). Ratio to offline synthesis of the same utterance.", "",
              "| utterance | offline GFLOP | " + " | ".join(mode_name(c) for c in modes[1:]) + " |",
              "| --- | --- | " + " | ".join("---" for _ in modes[1:]) + " |"]
    for secs in args.lengths or [10.0]:
        n = int(round(TOKENS_PER_SECOND * secs))
        chunks = chunk_schedule(n, 10, 2.0, 100)
        offline = estimator_flops(full, 2, 2 * (50 + n)).total * 10
        cells = []
        for c in modes[1:]:
            flops = solve_flops(full, planned_calls(80, 50, chunks, c, 10))
            cells.append(f"{flops / 1e9:,.0f} ({flops / offline:.2f}x)")
        lines.append(f"| {secs:g} s | {offline / 1e9:,.0f} | " + " | ".join(cells) + " |")
        print(f"full size {secs:g} s: offline {offline / 1e9:.0f} GFLOP; " + "; ".join(cells), flush=True)
    lines.append("")
    lines += ["Targets (issue: bounded-cost streaming): a 60 s stream costs at most 1.5x its offline synthesis; the "
              "last chunk's latency within 1.25x of a same-size chunk early on; error vs ground truth within 5% "
              "of offline's; seam roughness at most 1.1.", "",
              f"Total run time {time.perf_counter() - t_start:.0f} s."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
