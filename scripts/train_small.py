#!/usr/bin/env python3
"""Retrain the small demo models from scratch: corpus, CFM teacher, meanflow student, held-out files.

Examples::

    make train                                       # installs espeak-ng when missing, then runs this
    .venv/bin/python scripts/train_small.py          # the shipped checkpoints/trained/ (about 31 min, 2 cores)
    .venv/bin/python scripts/train_small.py --quick --out /tmp/trained   # a smoke run of a minute or two

Steps (all seeded; see ``s3flow_training``):

1. ``scripts/make_dataset.py``: espeak-ng corpus -> ``<workdir>/dataset.npz`` (reused when it exists
   and was made with the same settings);
2. teacher: ``train_teacher`` (CFM loss, condition dropout 0.2) -> ``<out>/teacher.safetensors``;
3. student: ``train_student`` (meanflow, distilled from the guided teacher) -> ``<out>/student.safetensors``;
4. ``<out>/heldout.npz`` (the held-out utterances with prompts and ground truth, the first one per voice
   first),
   ``<out>/demo_utt.npz`` (a ~5 s held-out utterance in flow_infer / s3flow_client ``--inputs`` format),
   ``<out>/training.json`` (settings, losses, time of each step).

Both checkpoints record their FlowConfig, so ``load_flow`` and ``scripts/build_repository.py
--checkpoint`` need no flags. At the end the script reloads both files and checks that the teacher's
guided 10-step mel of the held-out utterances is closer to the ground truth than the mean-mel baseline
(the mel every frame of which is the voice's mean); it exits non-zero if not, or on any failure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backend"))  # fallback when the package is not installed
sys.path.insert(0, str(ROOT / "scripts"))

from s3flow.model.checkpoint import load_flow, write_checkpoint  # noqa: E402
from s3flow_training.data import DataSettings, Dataset, espeak_available  # noqa: E402
from s3flow_training.evaluate import (heldout_utterances, save_demo_input, save_heldout,  # noqa: E402
                                      synthesize_one)
from s3flow_training.distill import train_student  # noqa: E402
from s3flow_training.train import TrainSettings, train_teacher  # noqa: E402

DEFAULT_OUT = ROOT / "checkpoints" / "trained"
DEFAULT_WORKDIR = ROOT / "build" / "small_data"
#: The demo utterance's target length in tokens (5 s). Every other held-out utterance ships in heldout.npz
#: (sentences never seen in training, with prompts and ground truth: a few MB), so evaluation and the
#: streaming measurements need no espeak-ng.
DEMO_TOKENS = 125


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def get_dataset(settings: DataSettings, workdir: Path, log) -> Dataset:
    import make_dataset
    path = workdir / "dataset.npz"
    if path.is_file():
        ds = Dataset.load(path)
        if ds.settings == settings:
            log(f"reusing {path}")
            return ds
        log(f"{path} was made with other settings: rebuilding")
    if not espeak_available():
        raise SystemExit("error: espeak-ng not found; `make train` installs it (apt-get install -y espeak-ng)")
    make_dataset.make(settings, path, log=log)
    return Dataset.load(path)


def pick_shipped(utts, n: int, demo_tokens: int):
    """The demo utterance (length closest to demo_tokens) and n utterances spread over the voices."""
    demo = min(range(len(utts)), key=lambda k: abs(len(utts[k].speech_tokens) - demo_tokens))
    chosen, voices = [], set()
    for k, u in enumerate(utts):  # first one per voice, then fill in order
        if u.voice not in voices and k != demo:
            chosen.append(k)
            voices.add(u.voice)
    chosen += [k for k in range(len(utts)) if k not in chosen and k != demo]
    return demo, sorted(chosen[:n])


def main(argv=None) -> int:
    t_all, c_all = time.perf_counter(), cpu_seconds()
    d, s = DataSettings(), TrainSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="(default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="corpus cache (default: %(default)s)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads (default: %(default)s = this machine's cores)")
    p.add_argument("--seed", type=int, default=s.seed, help="(default: %(default)s)")
    p.add_argument("--teacher-steps", type=int, default=s.teacher_steps, help="(default: %(default)s)")
    p.add_argument("--student-rounds", type=int, default=s.student_rounds, help="(default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a small corpus and a few steps: a smoke run")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = []

    def log(msg: str) -> None:
        line = f"[{time.perf_counter() - t_all:7.1f} s] {msg}"
        print(line, flush=True)
        lines.append(line)

    data_settings = dataclasses.replace(d, seed=args.seed)
    settings = dataclasses.replace(s, seed=args.seed, teacher_steps=args.teacher_steps,
                                   student_rounds=args.student_rounds)
    if args.quick:
        data_settings = dataclasses.replace(data_settings, n_sentences=40, codebook_size=64, kmeans_iters=10)
        settings = dataclasses.replace(settings, teacher_steps=min(args.teacher_steps, 40),
                                       student_rounds=min(args.student_rounds, 10), batch_size=8,
                                       fine_steps=6, log_every=10)
    timings = {}

    def phase(name, fn):
        t, c = time.perf_counter(), cpu_seconds()
        out = fn()
        timings[name] = {"wall_s": round(time.perf_counter() - t, 1), "cpu_s": round(cpu_seconds() - c, 1)}
        log(f"{name}: {timings[name]['wall_s']} s wall, {timings[name]['cpu_s']} s CPU")
        return out

    workdir = args.workdir if not args.quick or args.workdir != DEFAULT_WORKDIR else args.out / "data_quick"
    ds = phase("dataset", lambda: get_dataset(data_settings, workdir, log))
    teacher = phase("teacher", lambda: train_teacher(ds, settings, log=log))
    args.out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(teacher, args.out / "teacher.safetensors")
    student = phase("student", lambda: train_student(teacher, ds, settings, log=log))
    write_checkpoint(student, args.out / "student.safetensors")

    utts = heldout_utterances(ds, seed=args.seed)
    demo, shipped = pick_shipped(utts, len(utts), DEMO_TOKENS)
    save_heldout(args.out / "heldout.npz", [utts[k] for k in shipped])
    save_demo_input(args.out / "demo_utt.npz", utts[demo], seed=0)
    log(f"wrote {args.out}/teacher.safetensors, student.safetensors, heldout.npz ({len(shipped)} utterances), "
        f"demo_utt.npz ({len(utts[demo].speech_tokens) / 25:.1f} s: {utts[demo].text!r})")

    # self-check: reload both files (no flags) and compare with a mean-mel baseline
    teacher2, student2 = load_flow(args.out / "teacher.safetensors"), load_flow(args.out / "student.safetensors")
    ok = not teacher2.config.meanflow and student2.config.meanflow
    errs, base = [], []
    for k in shipped[:3]:
        u = utts[k]
        mel, _ = synthesize_one(teacher2, u, 10, 0.7, seed=k)
        errs.append(np.abs(mel - u.mel).mean())
        base.append(np.abs(ds.voice_stats[u.voice, 0][:, None] - u.mel).mean())
    ok = ok and float(np.mean(errs)) < float(np.mean(base))
    log(f"check: teacher guided 10-step mean abs error {np.mean(errs):.3f} vs mean-mel baseline "
        f"{np.mean(base):.3f} on 3 held-out utterances: {'ok' if ok else 'FAILED'}")

    total = {"wall_s": round(time.perf_counter() - t_all, 1), "cpu_s": round(cpu_seconds() - c_all, 1)}
    log(f"total: {total['wall_s']} s wall ({total['wall_s'] / 60:.1f} min), {total['cpu_s']} s CPU")
    info = {"data_settings": dataclasses.asdict(data_settings), "train_settings": dataclasses.asdict(settings),
            "teacher_config": teacher.config.to_dict(), "student_config": student.config.to_dict(),
            "parameters": {"teacher": sum(p.numel() for p in teacher.parameters()),
                           "teacher_estimator": sum(p.numel() for p in teacher.estimator.parameters()),
                           "student_estimator": sum(p.numel() for p in student.estimator.parameters())},
            "timings": {**timings, "total": total}, "threads": args.threads,
            "machine": {"cpus": torch.get_num_threads(), "processor": platform.processor() or platform.machine(),
                        "torch": torch.__version__, "load_average_at_end": list(map(float, _loadavg()))},
            "log": lines, "quick": args.quick}
    (args.out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0 if ok else 1


def _loadavg():
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


if __name__ == "__main__":
    sys.exit(main())
