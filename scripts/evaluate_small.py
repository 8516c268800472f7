#!/usr/bin/env python3
"""Measure the small trained models on held-out speech and write results/small_model.md and .png.

Examples::

    .venv/bin/python scripts/evaluate_small.py                    # after scripts/train_small.py
    .venv/bin/python scripts/evaluate_small.py --max-utterances 8 --out /tmp/small_model.md

Held-out utterances come from the corpus (``build/small_data/dataset.npz``, all of its held-out split)
when it exists, else from the shipped ``checkpoints/trained/heldout.npz``. For each solver (teacher
guided 10 / 2 steps, teacher unguided 10, student 2 / 1 steps), from the same seeded noise per
utterance: mel error against the ground truth and against the guided 10-step teacher, a detail ratio,
estimator calls and wall time. Then streamed (chunk by chunk through the StreamingEngine, in process)
vs offline synthesis, at chunk seams and away from them. And the side-by-side picture of ground truth,
teacher-10, teacher-2 and student-2 for the demo utterance.

Exits non-zero when the central claim fails: the 2-step student must be closer to the guided 10-step
teacher than the teacher cut to 2 steps is.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backend"))  # fallback when the package is not installed

from s3flow.model.checkpoint import load_flow  # noqa: E402
from s3flow_training.data import Dataset  # noqa: E402
from s3flow_training.evaluate import (METHODS, HeldoutUtterance, evaluate_methods, heldout_utterances,  # noqa: E402
                                      load_heldout, stream_vs_offline, synthesize_one)

TRAINED = ROOT / "checkpoints" / "trained"


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def demo_heldout(path: Path) -> HeldoutUtterance:
    d = np.load(path)
    return HeldoutUtterance(d["speech_tokens"][0], d["prompt_tokens"][0], np.ascontiguousarray(d["prompt_feat"][0].T),
                            d["embedding"][0], d["mel"][0], str(d["text"]) if "text" in d else "")


def picture(utt: HeldoutUtterance, panels: list[tuple[str, np.ndarray]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lo, hi = float(utt.mel.min()), float(utt.mel.max())
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.1 * len(panels)), sharex=True)
    for ax, (title, mel) in zip(axes, panels):
        im = ax.imshow(mel, origin="lower", aspect="auto", vmin=lo, vmax=hi, cmap="magma", interpolation="nearest")
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_ylabel("mel bin")
    axes[-1].set_xlabel("frame (20 ms)")
    fig.colorbar(im, ax=axes, shrink=0.6, label="log-mel")
    fig.suptitle(f"held-out: \"{utt.text}\"", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", type=Path, default=TRAINED / "teacher.safetensors", help="(default: %(default)s)")
    p.add_argument("--student", type=Path, default=TRAINED / "student.safetensors", help="(default: %(default)s)")
    p.add_argument("--dataset", type=Path, default=ROOT / "build" / "small_data" / "dataset.npz",
                   help="corpus with the held-out split (default: %(default)s; falls back to heldout.npz)")
    p.add_argument("--heldout", type=Path, default=TRAINED / "heldout.npz", help="(default: %(default)s)")
    p.add_argument("--demo", type=Path, default=TRAINED / "demo_utt.npz", help="(default: %(default)s)")
    p.add_argument("--max-utterances", type=int, default=0, help="0: all held-out utterances (default)")
    p.add_argument("--stream-utterances", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "small_model.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    teacher, student = load_flow(args.teacher), load_flow(args.student)
    if teacher.config.meanflow or not student.config.meanflow:
        print("error: --teacher must be a regular checkpoint and --student a meanflow one", file=sys.stderr)
        return 1
    if args.dataset.is_file():
        ds = Dataset.load(args.dataset)
        utts, source = heldout_utterances(ds), f"the corpus' held-out split ({rel(args.dataset)})"
        baseline = lambda u: ds.voice_stats[u.voice, 0][:, None]  # noqa: E731
    else:
        ds, utts, source = None, load_heldout(args.heldout), rel(args.heldout)
        baseline = None
    if args.max_utterances:
        utts = utts[:args.max_utterances]
    seconds = sum(u.frames for u in utts) / 50
    print(f"{len(utts)} held-out utterances ({seconds:.0f} s) from {source}", flush=True)

    results, outputs = evaluate_methods(teacher, student, utts)
    ref = results[0]
    # sample-to-sample spread of the reference: teacher-10 from other noise
    other = [synthesize_one(teacher, u, 10, 0.7, seed=10_000 + k)[0] for k, u in enumerate(utts)]
    n_el = sum(u.frames for u in utts) * utts[0].mel.shape[0]
    spread = sum(np.abs(o - r).sum() for o, r in zip(other, outputs[ref.method.name])) / n_el
    base = (sum(np.abs(baseline(u) - u.mel).sum() for u in utts) / n_el) if baseline else None

    stream_utts = utts[:args.stream_utterances]
    streams = [stream_vs_offline(teacher, stream_utts, "teacher, guided, 10 steps"),
               stream_vs_offline(student, stream_utts, "student, 2 steps")]

    demo = demo_heldout(args.demo)
    panels = [("ground truth", demo.mel)]
    for name, flow, steps, rate in [("teacher, guided, 10 steps", teacher, 10, 0.7),
                                    ("teacher, guided, 2 steps", teacher, 2, 0.7),
                                    ("student (meanflow), 2 steps", student, 2, None)]:
        mel, _ = synthesize_one(flow, demo, steps, rate, seed=0)
        panels.append((f"{name}: mean abs error vs ground truth {np.abs(mel - demo.mel).mean():.3f}", mel))
    png = args.out.with_suffix(".png")
    picture(demo, panels, png)

    info = {}
    info_path = args.teacher.parent / "training.json"
    if info_path.is_file():
        info = json.loads(info_path.read_text())
    write_report(args, results, spread, base, streams, info, len(utts), seconds, source, png,
                 time.perf_counter() - t_start, ds)
    print(args.out.read_text())

    student2 = next(r for r in results if r.method.model == "student" and r.method.n_steps == 2)
    teacher2 = next(r for r in results if r.method.model == "teacher" and r.method.n_steps == 2)
    if not student2.mae_ref < teacher2.mae_ref:
        print("FAILED: the 2-step student is not closer to the guided 10-step teacher than the 2-step teacher",
              file=sys.stderr)
        return 1
    return 0


def write_report(args, results, spread, base, streams, info, n_utts, seconds, source, png, eval_s, ds):
    ref = results[0]
    L = []
    L.append("# Small trained model: teacher (CFM, guided) and 2-step meanflow student\n")
    L.append(f"Made by `scripts/train_small.py` (retrain) and `scripts/evaluate_small.py` (these figures). "
             f"Held-out: {n_utts} utterances, {seconds:.0f} s of speech, from {source}: sentences never seen in "
             f"training, spoken by the training voices, each with a 1.6-2.4 s prompt cut from another held-out "
             f"utterance of the same voice. Errors are in log-mel units (natural log), averaged over all frames "
             f"and 80 bins of the generated region; every solver starts from the same seeded noise "
             f"(`FrameNoise(seed = utterance index)`).\n")
    L.append("## Solvers compared\n")
    L.append("| solver | mean abs error vs ground truth | MSE vs ground truth | mean abs error vs teacher-10 | "
             "MSE vs teacher-10 | detail ratio | estimator calls | network evaluations (rows) | wall time | "
             "time vs teacher-10 |")
    L.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        L.append(f"| {r.method.name} | {r.mae_gt:.3f} | {r.mse_gt:.3f} | {r.mae_ref:.3f} | {r.mse_ref:.3f} | "
                 f"{r.detail_ratio:.2f} | {r.calls} | {r.evaluations} | {r.wall_s:.1f} s | "
                 f"{r.wall_s / ref.wall_s:.2f} |")
    L.append("")
    s2 = next(r for r in results if r.method.model == "student" and r.method.n_steps == 2)
    t2 = next(r for r in results if r.method.model == "teacher" and r.method.n_steps == 2)
    holds = s2.mae_ref < t2.mae_ref and s2.mae_gt <= t2.mae_gt
    L.append(f"**Verdict on the claim** (a 2-step meanflow student distilled from the guided 10-step teacher keeps "
             f"the teacher's quality where the teacher cut to 2 steps does not): "
             f"{'it holds' if holds else 'it does not hold'} here: the 2-step student is {s2.mae_ref:.3f} from "
             f"teacher-10 against {t2.mae_ref:.3f} for teacher-2, and {s2.mae_gt:.3f} from the ground truth "
             f"against {t2.mae_gt:.3f} for teacher-2 and {ref.mae_gt:.3f} for teacher-10 itself, at "
             f"{s2.evaluations} network evaluations instead of {ref.evaluations}.\n")
    L.append(f"- Reference spread: the guided 10-step teacher from *another* noise seed is {spread:.3f} (mean abs) "
             f"from the same teacher's output: the distance between two equally good samples.")
    if base is not None:
        L.append(f"- Baseline: the voice's mean log-mel spectrum in every frame is {base:.3f} (mean abs) from the "
                 f"ground truth.")
    L.append("- Detail ratio: mean absolute frame-to-frame change of the output over that of the ground truth "
             "(1 = as much fine temporal structure as real mel; an over-smoothed, averaged output is below 1; above 1, "
             "the output keeps per-pixel noise from its starting point, as this small model does: its 128-channel "
             "U-Net learns the velocity's -z part only partly in a CPU-sized run).")
    L.append("- Estimator calls per utterance; network evaluations count batch rows (guidance runs the "
             "conditional and unconditional rows in one 2-row call). Wall time: all utterances one by one, "
             "batch of one, torch eager on this CPU, encoder included.")
    L.append("")
    L.append("## Streamed vs offline (trained model)\n")
    L.append(f"{min(args.stream_utterances, n_utts)} held-out "
             f"utterances streamed through `s3flow.engine.streaming.StreamingEngine` in process (the served chunk logic: "
             f"each chunk re-runs the encoder and the solver over the whole prefix with the carried `noised_mels` "
             f"pinned, the 6 lookahead frames withheld until the next chunk) in chunks of 10, 20, 40, 80... "
             f"tokens, against offline synthesis of the same tokens and seed. Seam frames: within 3 frames of "
             f"a chunk boundary.\n")
    L.append("| model | seams | seam frames | other frames | mean abs, seams | mean abs, elsewhere | max abs, seams | "
             "max abs, elsewhere | vs ground truth, streamed | vs ground truth, offline |")
    L.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in streams:
        L.append(f"| {s.name} | {s.seams} | {s.seam_frames} | {s.other_frames} | {s.mae_seam:.4f} | "
                 f"{s.mae_other:.4f} | {s.max_seam:.3f} | {s.max_other:.3f} | {s.mae_vs_gt_streamed:.3f} | "
                 f"{s.mae_vs_gt_offline:.3f} |")
    L.append("")
    L.append(f"## Picture\n\n![ground truth, teacher-10, teacher-2, student-2]({png.name})\n")
    L.append(f"`{png.name}`: the demo utterance (`checkpoints/trained/demo_utt.npz`), same noise for all three "
             f"solvers, same colour scale.\n")
    if info:
        t = info["timings"]
        d, s = info["data_settings"], info["train_settings"]
        L.append("## Training (from `checkpoints/trained/training.json`)\n")
        L.append(f"- Retrain command: `make train` (= `.venv/bin/python scripts/train_small.py`), "
                 f"{info['threads']} torch thread(s): **{t['total']['wall_s'] / 60:.1f} min wall** "
                 f"({t['total']['cpu_s'] / 60:.1f} min CPU): corpus {t['dataset']['wall_s']:.0f} s"
                 f"{' (reused from an earlier run; about 54 s when made)' if t['dataset']['wall_s'] < 5 else ''}, teacher "
                 f"{t['teacher']['wall_s']:.0f} s, student {t['student']['wall_s']:.0f} s. Load average at the end "
                 f"{info['machine'].get('load_average_at_end')} on {info['machine']['cpus']} cores (above the "
                 f"core count: other jobs shared the machine).")
        if ds is not None:
            tr, he = ds.split(False), ds.split(True)
            L.append(f"- Corpus: {d['n_sentences']} sentences x {d['voices_per_sentence']} of 8 espeak-ng voices "
                     f"-> {len(tr)} training utterances ({sum(ds.utterances[i].n_tokens for i in tr) / 25 / 60:.0f} "
                     f"min), {len(he)} held-out; {d['codebook_size']}-centroid k-means tokens at 25/s.")
        L.append(f"- Sizes: teacher {info['parameters']['teacher']:,} parameters (estimator "
                 f"{info['parameters']['teacher_estimator']:,}); student estimator "
                 f"{info['parameters']['student_estimator']:,} (the time mixer added). Configs are stored in "
                 f"the checkpoints' metadata.")
        L.append(f"- Teacher: {s['teacher_steps']} AdamW steps of {s['batch_size']} examples (up to "
                 f"{s['max_tokens']} tokens each, a same-voice prompt with probability {s['prompt_prob']}), "
                 f"peak lr {s['teacher_lr']}, condition dropout 0.2 (1.0 for the first {s.get('uncond_steps', 0)} "
                 f"steps), cosine-warped t, sigma_min 1e-6; residual branches start at zero, the output bias at the "
                 f"mean log-mel; the shipped weights are an EMA (decay {s.get('ema_decay')}).")
        L.append(f"- Student: {s['student_rounds']} rounds; each integrates the guided teacher (w = "
                 f"{s['guidance_rate']}) over the cosine {s['fine_steps']}-step grid with {s['keep_times']} "
                 f"inserted, and takes one AdamW step (peak lr {s['student_lr']}) on the mean velocities over "
                 f"[0, 1], one half and a random pair of those times; encoder frozen.")
    L.append("")
    L.append(f"Evaluation: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch "
             f"thread(s), torch {torch.__version__}, {eval_s:.0f} s.\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(L))


if __name__ == "__main__":
    sys.exit(main())
