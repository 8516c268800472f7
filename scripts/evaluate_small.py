#!/usr/bin/env python3
"""Measure the small trained models on held-out speech: intelligibility against the recordings, mel errors,
streamed vs offline; write results/small_model.md, its picture and a few wavs.

Examples::

    .venv/bin/python scripts/evaluate_small.py                          # after scripts/train_small.py
    .venv/bin/python scripts/evaluate_small.py --max-utterances 8 --out /tmp/small_model.md --no-served

Inputs: the shipped ``checkpoints/trained/`` files (``heldout.npz``: sentences never seen in training,
with their recordings; ``outside.npz``: sentences outside the corpus' grammar and words; the teacher, the
student and the vocoder), so neither the corpus nor espeak-ng is needed.

1. **Intelligibility** (``s3flow_training.intelligibility``): STOI, ESTOI and a log-spectral distance of
   each kind of audio against the recording: Griffin-Lim and the trained vocoder on the true mel (the
   vocoder's ceiling), the guided 10-step teacher offline (vocoder and Griffin-Lim), the same **streamed
   through a real tritonserver** (``token2wav``, the bounded-context default, the client's chunk schedule),
   the 2-step and 1-step student streamed, and white noise (the floor).
2. **Mel errors per solver** (teacher guided 10 / 2 steps, unguided 10, student 2 / 1): error against the
   ground truth and against teacher-10, detail ratio, estimator calls, wall time.
3. **Streamed vs offline mel in process** (the prefix re-run mode, which must equal offline up to the seams).
4. The demo utterance's picture (``small_model.png``) and wavs of three held-out sentences
   (``small_model_wavs/``: recording, vocoder on the true mel, teacher-10 and student-2 streamed).

Exits non-zero when a claim fails: the 2-step student must be closer to teacher-10 than the teacher cut to 2
steps; the vocoder on the true mel must beat Griffin-Lim's ESTOI.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

from s3flow_contract.tensors import FRAMES_PER_SECOND
from s3flow.model.checkpoint import load_flow
from s3flow_client.audio import write_wav
from s3flow.model.vocoder import load_vocoder
from s3flow.runtime.vocoder import vocode
from s3flow_training.evaluate import METHODS, evaluate_methods, stream_vs_offline, synthesize_one
from s3flow_training.intelligibility import (RATE, griffin_lim, intelligibility, log_spectral_distance,
                                             to_16k)
from s3flow_training.package import HeldoutUtterance, load_demo_input, load_heldout

TRAINED = ROOT / "checkpoints" / "trained"


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


@dataclass
class Scores:
    """Means over a set of utterances (audio at 24 kHz against the 16 kHz recordings)."""
    name: str
    stoi: float
    estoi: float
    lsd_db: float
    mel_mae: Optional[float] = None     # mean |mel - ground truth| where the audio came from a generated mel
    per_utterance_estoi: tuple = ()


def score(name: str, utts: Sequence[HeldoutUtterance], audio: Sequence[np.ndarray],
          mels: Optional[Sequence[np.ndarray]] = None) -> Scores:
    s = [intelligibility(u.reference, a) for u, a in zip(utts, audio)]
    lsd = [log_spectral_distance(u.reference, a) for u, a in zip(utts, audio)]
    mae = None if mels is None else float(np.mean([np.abs(m - u.mel).mean() for m, u in zip(mels, utts)]))
    return Scores(name, float(np.mean([x.stoi for x in s])), float(np.mean([x.estoi for x in s])),
                  float(np.mean(lsd)), mae, tuple(x.estoi for x in s))


def served_streams(checkpoint: Path, vocoder: Path, utts: Sequence[HeldoutUtterance], steps: Sequence[int],
                   workdir: Path) -> dict[int, list]:
    """Stream every utterance through token2wav of a real tritonserver serving ``checkpoint`` (the
    repository's defaults: bounded context, the cpu target), once per entry of ``steps``; returns
    {steps: [(mel, audio)]}."""
    from s3flow.repository import cli as build_repository
    from s3flow.server.triton_server import TritonServer
    from s3flow_client import StreamingClient, Utterance

    repo = workdir / f"repo_{checkpoint.stem}"
    if build_repository.main(["--checkpoint", str(checkpoint), "--vocoder-checkpoint", str(vocoder),
                              "--output", str(repo), "--no-voice"]) != 0:
        raise SystemExit(f"building the repository for {checkpoint} failed")
    out = {}
    with TritonServer(repo, log_file=workdir / f"{checkpoint.stem}.log") as server:
        client = StreamingClient(server.grpc_url, model="token2wav", timeout_s=600)
        for n in steps:
            results = []
            for k, u in enumerate(utts):   # one at a time: each stream alone, as a listener gets it
                [r] = client.synthesize([Utterance(u.speech_tokens, u.prompt_tokens,
                                                   np.ascontiguousarray(u.prompt_mel.T), u.xvector, seed=k,
                                                   n_timesteps=n)])
                results.append((r.mel, r.audio))
            out[n] = results
    return out


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


def intelligibility_rows(utts, teacher, student, hift, served, seed_base: int = 0) -> list[Scores]:
    """The intelligibility table's rows for one set of utterances (see the module docstring)."""
    rows = [score("Griffin-Lim (64 iterations) of the true mel", utts, [griffin_lim(u.mel) for u in utts]),
            score("trained vocoder on the true mel (its ceiling)", utts, [vocode(hift, u.mel) for u in utts])]
    t10 = [synthesize_one(teacher, u, 10, 0.7, seed=seed_base + k)[0] for k, u in enumerate(utts)]
    s2 = [synthesize_one(student, u, 2, None, seed=seed_base + k)[0] for k, u in enumerate(utts)]
    rows += [score("teacher, guided 10 steps, offline, Griffin-Lim", utts, [griffin_lim(m) for m in t10], t10),
             score("teacher, guided 10 steps, offline, vocoder", utts, [vocode(hift, m) for m in t10], t10),
             score("student, 2 steps, offline, vocoder", utts, [vocode(hift, m) for m in s2], s2)]
    names = {("teacher", 10): "teacher, guided 10 steps, **streamed through tritonserver** (token2wav)",
             ("student", 2): "student, 2 steps, streamed through tritonserver",
             ("student", 1): "student, 1 step, streamed through tritonserver"}
    for key, results in served.items():
        rows.append(score(names[key], utts, [a for _, a in results], [m for m, _ in results]))
    noise = [0.05 * np.random.default_rng(k).standard_normal(len(u.reference) * 3 // 2).astype(np.float32)
             for k, u in enumerate(utts)]
    rows.append(score("white noise (the floor)", utts, noise))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trained", type=Path, default=TRAINED, help="the shipped files (default: %(default)s)")
    p.add_argument("--max-utterances", type=int, default=0, help="0: every shipped held-out utterance (default)")
    p.add_argument("--stream-utterances", type=int, default=16, help="in-process streaming comparison "
                   "(default: %(default)s)")
    p.add_argument("--served", action=argparse.BooleanOptionalAction, default=True,
                   help="stream through a real tritonserver too (default: on)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "small_model.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    tr = args.trained
    teacher, student = load_flow(tr / "teacher.safetensors"), load_flow(tr / "student.safetensors")
    hift = load_vocoder(tr / "vocoder.safetensors")
    if teacher.config.meanflow or not student.config.meanflow:
        print("error: teacher.safetensors must be a regular checkpoint and student.safetensors a meanflow one",
              file=sys.stderr)
        return 1
    heldout = load_heldout(tr / "heldout.npz")
    outside = load_heldout(tr / "outside.npz")
    if args.max_utterances:
        heldout, outside = heldout[:args.max_utterances], outside[:max(2, args.max_utterances // 4)]
    seconds = sum(u.frames for u in heldout) / FRAMES_PER_SECOND
    print(f"{len(heldout)} held-out utterances ({seconds:.0f} s), {len(outside)} outside the corpus", flush=True)

    served = {"heldout": {}, "outside": {}}
    if args.served:
        with tempfile.TemporaryDirectory() as tmp:
            for name, utts in (("heldout", heldout), ("outside", outside)):
                t = served_streams(tr / "teacher.safetensors", tr / "vocoder.safetensors", utts, [10], Path(tmp))
                s = served_streams(tr / "student.safetensors", tr / "vocoder.safetensors", utts, [2, 1], Path(tmp))
                served[name] = {("teacher", 10): t[10], ("student", 2): s[2], ("student", 1): s[1]}
                print(f"streamed the {name} set through tritonserver", flush=True)
    tables = {"heldout": intelligibility_rows(heldout, teacher, student, hift, served["heldout"]),
              "outside": intelligibility_rows(outside, teacher, student, hift, served["outside"], seed_base=1000)}
    print("intelligibility measured", flush=True)

    results, outputs = evaluate_methods(teacher, student, heldout)
    other = [synthesize_one(teacher, u, 10, 0.7, seed=10_000 + k)[0] for k, u in enumerate(heldout)]
    n_el = sum(u.frames for u in heldout) * heldout[0].mel.shape[0]
    spread = sum(np.abs(o - r).sum() for o, r in zip(other, outputs[METHODS[0].name])) / n_el
    base = sum(np.abs(u.voice_mean[:, None] - u.mel).sum() for u in heldout) / n_el
    stream_utts = heldout[:args.stream_utterances]
    streams = [stream_vs_offline(teacher, stream_utts, "teacher, guided, 10 steps"),
               stream_vs_offline(student, stream_utts, "student, 2 steps")]

    demo = load_demo_input(tr / "demo_utt.npz")
    panels = [("ground truth", demo.mel)]
    for name, flow, steps, rate in [("teacher, guided, 10 steps", teacher, 10, 0.7),
                                    ("teacher, guided, 2 steps", teacher, 2, 0.7),
                                    ("student (meanflow), 2 steps", student, 2, None)]:
        mel, _ = synthesize_one(flow, demo, steps, rate, seed=0)
        panels.append((f"{name}: mean abs error vs ground truth {np.abs(mel - demo.mel).mean():.3f}", mel))
    png = args.out.with_suffix(".png")
    picture(demo, panels, png)
    wav_dir = args.out.parent / f"{args.out.stem}_wavs"
    wavs = write_examples(wav_dir, heldout, hift, served["heldout"])

    info = json.loads((tr / "training.json").read_text()) if (tr / "training.json").is_file() else {}
    write_report(args, tables, results, spread, base, streams, info, heldout, outside, seconds, png, wavs,
                 time.perf_counter() - t_start)
    print(args.out.read_text())

    ok = True
    student2 = next(r for r in results if r.method.model == "student" and r.method.n_steps == 2)
    teacher2 = next(r for r in results if r.method.model == "teacher" and r.method.n_steps == 2)
    if not student2.mae_ref < teacher2.mae_ref:
        print("FAILED: the 2-step student is not closer to the guided 10-step teacher than the 2-step teacher",
              file=sys.stderr)
        ok = False
    gl, voc = tables["heldout"][0], tables["heldout"][1]
    if not voc.estoi > gl.estoi:
        print(f"FAILED: the vocoder's ESTOI on the true mel ({voc.estoi:.3f}) is not above Griffin-Lim's "
              f"({gl.estoi:.3f})", file=sys.stderr)
        ok = False
    return 0 if ok else 1


def write_examples(folder: Path, utts: Sequence[HeldoutUtterance], hift, served: dict, n: int = 3) -> list[str]:
    """wavs (16 kHz) of the first ``n`` held-out utterances: recording, vocoder on the true mel, streamed."""
    names = []
    for k, u in enumerate(utts[:n]):
        items = [("recording", u.reference, RATE), ("vocoder_true_mel", vocode(hift, u.mel), 24000)]
        if ("teacher", 10) in served:
            items.append(("teacher10_streamed", served[("teacher", 10)][k][1], 24000))
        if ("student", 2) in served:
            items.append(("student2_streamed", served[("student", 2)][k][1], 24000))
        for name, audio, rate in items:
            path = folder / f"{k}_{name}.wav"
            write_wav(path, to_16k(audio, rate), RATE)
            names.append(path.name)
    return names


def write_report(args, tables, results, spread, base, streams, info, heldout, outside, seconds, png, wavs,
                 eval_s) -> None:
    ref = results[0]
    L = ["# Small trained model: vocoder, teacher (CFM, guided) and 2-step meanflow student\n",
         f"Made by `scripts/train_small.py` (training) and `scripts/evaluate_small.py` ({time.strftime('%Y-%m-%d')}, "
         f"these figures). Held-out: {len(heldout)} utterances, {seconds:.0f} s of speech "
         f"(`checkpoints/trained/heldout.npz`): sentences never seen in training, spoken by the training voices, "
         f"each with a 1.6-2.4 s prompt cut from other held-out utterances of the same voice. Outside the corpus: "
         f"{len(outside)} sentences of words and grammar the corpus never has (`outside.npz`), one per voice.\n"]
    L.append("## Intelligibility against the recording\n")
    L.append("STOI and extended STOI (ESTOI; `pystoi`, both signals at 16 kHz) and the log-spectral distance (dB, "
             "16 kHz, 512-point frames) of each kind of audio against the espeak-ng recording of the same sentence; "
             "means over the utterances. Flow rows also give the mean abs log-mel error of the mel behind the "
             "audio. *Streamed* rows are what a client of a real tritonserver receives: `token2wav`, the "
             "repository's defaults (bounded context, C = 100), the client's chunk schedule (10, 20, 40, 80, "
             "100 tokens), one utterance at a time.\n")
    for key, title, utts in (("heldout", "held-out sentences", heldout), ("outside", "sentences outside the corpus",
                                                                         outside)):
        L.append(f"### {title} ({len(utts)})\n")
        L.append("| audio | STOI | ESTOI | log-spectral distance (dB) | mel error vs truth |")
        L.append("| --- | ---: | ---: | ---: | ---: |")
        for r in tables[key]:
            mae = "" if r.mel_mae is None else f"{r.mel_mae:.3f}"
            L.append(f"| {r.name} | {r.stoi:.3f} | {r.estoi:.3f} | {r.lsd_db:.1f} | {mae} |")
        L.append("")
    h = {r.name: r for r in tables["heldout"]}
    streamed = next((r for r in tables["heldout"] if "streamed through tritonserver**" in r.name), None)
    offline = next(r for r in tables["heldout"] if r.name == "teacher, guided 10 steps, offline, vocoder")
    student2 = next((r for r in tables["heldout"] if r.name == "student, 2 steps, streamed through tritonserver"), None)
    if streamed is not None:
        L.append(f"Targets (issue: the main job speaks): vocoder on the true mel ESTOI "
                 f"{h['trained vocoder on the true mel (its ceiling)'].estoi:.3f} (target >= 0.80, Griffin-Lim "
                 f"{h['Griffin-Lim (64 iterations) of the true mel'].estoi:.3f}); the demo's served audio "
                 f"(teacher-10 streamed) {streamed.estoi:.3f} (target >= 0.60); streamed - offline "
                 f"{streamed.estoi - offline.estoi:+.3f} (target within 0.02); student-2 streamed - teacher-10 "
                 f"streamed {student2.estoi - streamed.estoi:+.3f} (target within 0.03).\n")
    L.append(f"Listen: [{', '.join(wavs[:4])}, ...](small_model_wavs/) (16 kHz: the recording, the vocoder on the "
             f"true mel, teacher-10 and student-2 streamed, for the first three held-out sentences).\n")
    L.append("## Mel per solver\n")
    L.append("Every solver starts from the same seeded noise (`FrameNoise(seed = utterance index)`); errors in "
             "log-mel units (natural log) over all frames and 80 bins of the generated region.\n")
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
    holds = s2.mae_ref < t2.mae_ref
    L.append(f"**Meanflow claim** (a 2-step student distilled from the guided 10-step teacher keeps the teacher's "
             f"output where the teacher cut to 2 steps does not): {'holds' if holds else 'does not hold'}: the "
             f"2-step student is {s2.mae_ref:.3f} from teacher-10 against {t2.mae_ref:.3f} for teacher-2, at "
             f"{s2.evaluations} network evaluations instead of {ref.evaluations}.\n")
    L.append(f"- Reference spread: teacher-10 from *another* noise seed is {spread:.3f} (mean abs) from the same "
             f"teacher's output: the distance between two equally good samples.")
    L.append(f"- Baseline: the voice's mean log-mel spectrum in every frame is {base:.3f} from the ground truth.")
    L.append("- Detail ratio: mean absolute frame-to-frame change of the output over that of the ground truth "
             "(1 = as much fine temporal structure as real mel; below 1 over-smoothed; above 1 per-pixel noise).")
    L.append("- Network evaluations count batch rows (guidance runs the conditional and unconditional rows in one "
             "2-row call). Wall time: all utterances one by one, torch eager, encoder included.\n")
    L.append("## Streamed vs offline mel (in process, prefix re-run mode)\n")
    L.append(f"{len(heldout[:args.stream_utterances])} held-out utterances streamed through "
             "`s3flow.engine.streaming.StreamingEngine` in the prefix re-run mode (each chunk re-solves the whole "
             "prefix with `noised_mels` pinned) in chunks of 10, 20, 40, 80... tokens, against offline synthesis "
             "of the same tokens and seed. Seam frames: within 3 frames of a chunk boundary. (The bounded-context "
             "default is measured in results/streaming.md.)\n")
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
    pilots = ROOT / "results" / "estimator_pilots.json"
    if pilots.is_file():
        doc = json.loads(pilots.read_text())
        L.append("## Choosing the estimator\n")
        L.append(f"{doc['what']} ({doc['date']}; {doc['script']}). {doc['note']}.\n")
        L.append("| estimator (channels x blocks x mid stages) | parameters | steps in 12 min | mel error vs truth | "
                 "detail ratio | ESTOI |")
        L.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in doc["pilots"]:
            L.append(f"| {r['config']} | {r['params']:,} | {r['steps']} | {r['mae']:.3f} | {r['detail_ratio']:.2f} | "
                     f"{r['estoi']:.3f} |")
        L.append("")
    if info.get("phases"):
        L.append("## Training (from `checkpoints/trained/training.json`)\n")
        L.append("| phase | steps | runs | wall | CPU | last losses |")
        L.append("| --- | ---: | ---: | ---: | ---: | --- |")
        for name, ph in info["phases"].items():
            last = ph["runs"][-1].get("losses") if ph["runs"] else None
            L.append(f"| {name} | {ph.get('steps_done', '')} | {len(ph['runs'])} | {ph.get('wall_s', 0) / 60:.1f} min | "
                     f"{ph.get('cpu_s', 0) / 60:.1f} min | {json.dumps(last) if last else ''} |")
        L.append("")
        params = info.get("parameters", {})
        if params:
            L.append("Sizes: " + ", ".join(f"{k} {v:,}" for k, v in params.items()) + " parameters; each checkpoint "
                     "records its config.\n")
    L.append(f"Evaluation: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), "
             f"torch {torch.__version__}, {eval_s:.0f} s.\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(L))


if __name__ == "__main__":
    sys.exit(main())
