#!/usr/bin/env python3
"""Train the small demo models in time-boxed, resumable runs: corpus, vocoder, CFM teacher, meanflow student.

Examples::

    make train                                               # installs espeak-ng when missing, runs this to the end
    .venv/bin/python scripts/train_small.py --budget-min 60  # one hour of work, then stop; run again to go on
    .venv/bin/python scripts/train_small.py --phases vocoder --budget-min 30
    .venv/bin/python scripts/train_small.py --quick --out /tmp/trained   # a smoke run of a few minutes
    .venv/bin/python scripts/train_small.py --phases vocoder_gan --budget-min 30   # adversarial vocoder candidate

Phases (all seeded; see ``s3flow_training``), in this order:

1. ``dataset``: the espeak-ng corpus -> ``<workdir>/dataset.npz`` (+ its waveforms), reused when it exists
   and was made with the same settings;
2. ``package``: the files that ship beside the checkpoints: ``heldout.npz`` (held-out sentences with
   prompts, ground-truth mel and the 16 kHz reference recordings), ``demo_utt.npz`` (the demo's ~5 s
   held-out sentence in the client's ``--inputs`` format, with its recording), ``frontend.npz`` (the
   corpus' voices, codebook and voice statistics: the small model's stand-in for T3's tokens);
3. ``vocoder``: HiFT on the corpus' waveforms -> ``<out>/vocoder.safetensors`` (``mel2wav.*`` layout);
4. ``teacher``: CFM loss, condition dropout 0.2 -> ``<out>/teacher.safetensors``;
5. ``student``: meanflow, distilled from the guided teacher -> ``<out>/student.safetensors``;
6. ``vocoder_gan`` (only when named in ``--phases``): the shipped vocoder trained on with discriminators
   (``s3flow_training.vocoder_gan``). It never replaces ``<out>/vocoder.safetensors``: each run writes a
   candidate folder (``--candidate``: a copy of ``<out>``'s files with the adversarial EMA weights as
   ``vocoder.safetensors``) for ``scripts/evaluate_small.py --trained <candidate>`` to compare; a model
   ships only after a paired evaluation says it is better. Its whole state (generator, EMA,
   discriminators, both optimisers) is ``<out>/state/vocoder_gan.pt``, committed with the checkpoints.

A phase's schedule is fixed (its total steps); each run does as much of it as ``--budget-min`` leaves
(the budget covers the whole invocation), writes the phase's current EMA weights to ``<out>`` and its
whole state to ``<workdir>/train_state/<phase>.pt``, and the next run goes on from there. Without that
state (a fresh clone) an unfinished phase goes on from its committed checkpoint and the step
``training.json`` records (fresh optimiser). The student starts when the teacher is finished.
``<out>/training.json`` records the settings, the configs, and for every phase each run's steps, losses,
wall and CPU seconds.

Checks at the end, on held-out sentences, for each finished phase (exit 1 when one fails): the teacher's
guided 10-step mel is closer to the ground truth than the voice's mean spectrum; the vocoder's audio of the
true mel is about as intelligible (ESTOI) as Griffin-Lim's of the same mel (``GRIFFIN_LIM_MARGIN``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

from s3flow.model.checkpoint import load_flow, write_checkpoint
from s3flow.model.vocoder import load_vocoder, write_vocoder_checkpoint
from s3flow.runtime.vocoder import vocode
from s3flow_training.data import DataSettings, Dataset, build_dataset, espeak_available
from s3flow_training.distill import train_student
from s3flow_training.evaluate import synthesize_one
from s3flow_training.intelligibility import griffin_lim, intelligibility
from s3flow_training.package import load_heldout, write_package
from s3flow_training.train import TrainSettings, train_teacher
from s3flow_training.vocoder_gan import VocoderGanSettings, train_vocoder_gan
from s3flow_training.vocoder_train import GRIFFIN_LIM_MARGIN, VocoderCorpus, VocoderTrainSettings, train_vocoder

DEFAULT_OUT = ROOT / "checkpoints" / "trained"
DEFAULT_WORKDIR = ROOT / "build" / "small_data"
DEFAULT_CANDIDATE = ROOT / "build" / "candidate"
PHASES = ("dataset", "package", "vocoder", "teacher", "student")
#: Phases that run only when ``--phases`` names them.
EXTRA_PHASES = ("vocoder_gan",)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def get_dataset(settings: DataSettings, path: Path, log) -> Dataset:
    if path.is_file():
        ds = Dataset.load(path)
        if ds.settings == settings:
            log(f"reusing {path}")
            return ds
        log(f"{path} was made with other settings: rebuilding")
    if not espeak_available():
        raise SystemExit("error: espeak-ng not found; `make train` installs it (apt-get install -y espeak-ng)")
    build_dataset(settings, log=log).save(path)
    return Dataset.load(path)


def settings_for(args) -> tuple[DataSettings, VocoderTrainSettings, TrainSettings, VocoderGanSettings]:
    data, voc, flow = DataSettings(seed=args.seed), VocoderTrainSettings(seed=args.seed), TrainSettings(seed=args.seed)
    gan = VocoderGanSettings(seed=args.seed)
    if args.quick:
        data = dataclasses.replace(data, n_sentences=40, voices_per_sentence=2, codebook_size=64, kmeans_iters=10)
        voc = dataclasses.replace(voc, steps=20, true_f0_steps=10, warmup_steps=5, log_every=10, save_every=10)
        flow = dataclasses.replace(flow, teacher_steps=30, student_rounds=8, batch_size=8, fine_steps=6,
                                   prompt_tokens=(5, 40), uncond_steps=10, warmup_steps=10, log_every=10,
                                   save_every=10)
        gan = dataclasses.replace(gan, steps=12, disc_warmup_steps=4, generator_warmup_steps=2, log_every=4,
                                  save_every=4)
    if args.vocoder_steps is not None:
        voc = dataclasses.replace(voc, steps=args.vocoder_steps)
    if args.vocoder_gan_steps is not None:
        gan = dataclasses.replace(gan, steps=args.vocoder_gan_steps)
    return data, voc, flow, gan


#: The settings each phase's runs depend on: a phase's record is kept while they stay the same.
PHASE_SETTINGS = {"dataset": ("data_settings",), "package": ("data_settings",),
                  "vocoder": ("data_settings", "vocoder_settings"),
                  "teacher": ("data_settings", "train_settings"), "student": ("data_settings", "train_settings"),
                  "vocoder_gan": ("data_settings", "vocoder_gan_settings")}
#: A phase's schedule length, which may grow without dropping its record (the phase goes on from where it was).
PHASE_LENGTH = {"vocoder": ("vocoder_settings", "steps"), "vocoder_gan": ("vocoder_gan_settings", "steps")}


def _same(old: dict, new: dict, group: str, length=None) -> bool:
    """Whether settings ``group`` is unchanged, but for a schedule length (``PHASE_LENGTH``) that grew."""
    a, b = dict(old.get(group) or {}), dict(new.get(group) or {})
    if length is not None and length[0] == group and a.get(length[1], 0) <= b.get(length[1], 0):
        a.pop(length[1], None)
        b.pop(length[1], None)
    return a == b


class Record:
    """``training.json``: settings, configs and every phase's runs; written after each phase run. A phase's
    runs are kept while the settings it depends on (``PHASE_SETTINGS``) are unchanged, and dropped (the phase
    starts afresh) when they change."""

    def __init__(self, path: Path, base: dict):
        self.path = path
        base = json.loads(json.dumps(base))   # as the file holds it (tuples are lists there)
        old = json.loads(path.read_text()) if path.is_file() else {}
        phases = {name: ph for name, ph in old.get("phases", {}).items()
                  if old.get("quick") == base.get("quick")
                  and all(_same(old, base, k, PHASE_LENGTH.get(name)) for k in PHASE_SETTINGS.get(name, tuple(base)))}
        for name, (group, key) in PHASE_LENGTH.items():   # a longer schedule: the phase goes on
            if name in phases and phases[name]["steps_done"] < (base.get(group) or {}).get(key, 0):
                phases[name]["finished"] = False
        self.data = {**base, "phases": phases}
        self.data.update({k: old[k] for k in ("configs", "parameters") if k in old})

    def phase(self, name: str) -> dict:
        return self.data["phases"].setdefault(name, {"finished": False, "steps_done": 0, "runs": []})

    def add_run(self, name: str, run: dict, steps_done: int, finished: bool) -> None:
        p = self.phase(name)
        p["runs"].append(run)
        p["steps_done"], p["finished"] = steps_done, finished
        p["wall_s"] = round(sum(r["wall_s"] for r in p["runs"]), 1)
        p["cpu_s"] = round(sum(r["cpu_s"] for r in p["runs"]), 1)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")


def write_candidate(shipped: Path, candidate: Path, hift) -> Path:
    """A candidate folder: every file of ``shipped`` (not its folders) but the vocoder, and ``hift`` as
    ``vocoder.safetensors``, so ``scripts/evaluate_small.py --trained <candidate>`` measures it beside the
    shipped one. Returns the vocoder's path."""
    if candidate.resolve() == shipped.resolve():
        raise ValueError(f"the candidate folder {candidate} is the shipped folder itself: choose another")
    candidate.mkdir(parents=True, exist_ok=True)
    for f in shipped.iterdir():
        if f.is_file() and f.name != "vocoder.safetensors":
            shutil.copy2(f, candidate / f.name)
    return write_vocoder_checkpoint(hift, candidate / "vocoder.safetensors")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="(default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help="corpus and training state (default: %(default)s)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated subset of {', '.join(PHASES + EXTRA_PHASES)} (default: %(default)s)")
    p.add_argument("--budget-min", type=float, default=None,
                   help="stop after this many minutes of this invocation (default: run every phase to its end)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads (default: %(default)s = this machine's cores)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a tiny corpus and a few steps: a smoke run")
    p.add_argument("--vocoder-steps", type=int, default=None,
                   help="the vocoder's schedule length (default: VocoderTrainSettings'); a longer one than the "
                        "shipped vocoder's goes on from it")
    p.add_argument("--vocoder-gan-steps", type=int, default=None,
                   help="the adversarial phase's schedule length (default: VocoderGanSettings'); a longer one "
                        "goes on from its state")
    p.add_argument("--candidate", type=Path, default=DEFAULT_CANDIDATE,
                   help="vocoder_gan's candidate folder: <out>'s files with the new vocoder (default: %(default)s)")
    args = p.parse_args(argv)
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = set(phases) - set(PHASES + EXTRA_PHASES)
    if unknown:
        p.error(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES + EXTRA_PHASES)}")
    if "vocoder_gan" in phases and args.candidate.resolve() == args.out.resolve():
        p.error("--candidate must not be --out: the adversarial vocoder ships only after a paired evaluation")
    torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    deadline = None if args.budget_min is None else t_all + 60 * args.budget_min
    workdir = args.workdir if not (args.quick and args.workdir == DEFAULT_WORKDIR) else args.out / "data_quick"
    corpus = workdir / "dataset.npz"
    state_dir = workdir / "train_state"
    data_s, voc_s, flow_s, gan_s = settings_for(args)
    record = Record(args.out / "training.json", {
        "data_settings": dataclasses.asdict(data_s), "vocoder_settings": dataclasses.asdict(voc_s),
        "train_settings": dataclasses.asdict(flow_s), "vocoder_gan_settings": dataclasses.asdict(gan_s),
        "quick": args.quick})

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_all:7.1f} s] {msg}", flush=True)

    def budget_left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.perf_counter())

    def run_phase(name, fn):
        """Run one slice of a phase; fn(budget_s) -> (steps_done, finished, losses)."""
        t, c = time.perf_counter(), cpu_seconds()
        steps_done, finished, losses = fn(budget_left())
        run = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "steps_to": steps_done,
               "wall_s": round(time.perf_counter() - t, 1), "cpu_s": round(cpu_seconds() - c, 1),
               "threads": args.threads, "losses": losses,
               "load_average": [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]}
        record.add_run(name, run, steps_done, finished)
        log(f"{name}: {run['wall_s']} s wall, {run['cpu_s']} s CPU, at step {steps_done}"
            f"{'' if finished else ' (not finished: run again to go on)'}")
        return finished

    ds = get_dataset(data_s, corpus, log) if set(phases) - {"dataset"} or "dataset" in phases else None
    if "dataset" in phases and not record.phase("dataset")["finished"]:
        record.add_run("dataset", {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                                   "wall_s": round(time.perf_counter() - t_all, 1), "cpu_s": round(cpu_seconds(), 1),
                                   "utterances": len(ds.utterances)}, 0, True)
    if "package" in phases:
        write_package(ds, corpus, args.out, seed=args.seed, log=log)

    if "vocoder" in phases and not record.phase("vocoder")["finished"] and budget_left() != 0:
        def vocoder_run(budget):
            ckpt = args.out / "vocoder.safetensors"
            done = record.phase("vocoder")["steps_done"]
            start = load_vocoder(ckpt) if done and ckpt.is_file() else None
            hift, info = train_vocoder(VocoderCorpus.open(corpus, log=log), voc_s, state_dir / "vocoder.pt",
                                       budget, start=start, start_step=done if start else 0, log=log)
            write_vocoder_checkpoint(hift, ckpt)
            return info["steps_done"], info["finished"], info["last_losses"]
        run_phase("vocoder", vocoder_run)

    if "teacher" in phases and not record.phase("teacher")["finished"] and budget_left() != 0:
        def teacher_run(budget):
            ckpt = args.out / "teacher.safetensors"
            done = record.phase("teacher")["steps_done"]
            start = load_flow(ckpt) if done and ckpt.is_file() else None
            flow, info = train_teacher(ds, flow_s, log=log, state_path=state_dir / "teacher.pt", budget_s=budget,
                                       start=start, start_step=done if start else 0)
            write_checkpoint(flow, ckpt)
            return info["steps_done"], info["finished"], info["last_losses"]
        run_phase("teacher", teacher_run)

    if "student" in phases and not record.phase("student")["finished"] and budget_left() != 0:
        if not record.phase("teacher")["finished"]:
            log("student: waits for the teacher to finish")
        else:
            def student_run(budget):
                ckpt = args.out / "student.safetensors"
                done = record.phase("student")["steps_done"]
                start = load_flow(ckpt) if done and ckpt.is_file() else None
                student, info = train_student(load_flow(args.out / "teacher.safetensors"), ds, flow_s, log=log,
                                              state_path=state_dir / "student.pt", budget_s=budget, start=start,
                                              start_step=done if start else 0)
                write_checkpoint(student, ckpt)
                return info["steps_done"], info["finished"], info["last_losses"]
            run_phase("student", student_run)

    candidate = None
    if "vocoder_gan" in phases and not record.phase("vocoder")["finished"]:
        log("vocoder_gan: waits for the vocoder to finish")
    elif "vocoder_gan" in phases and not record.phase("vocoder_gan")["finished"] and budget_left() != 0:
        made = {}

        def vocoder_gan_run(budget):
            hift, info = train_vocoder_gan(VocoderCorpus.open(corpus, log=log), gan_s,
                                           start=load_vocoder(args.out / "vocoder.safetensors"),
                                           state_path=args.out / "state" / "vocoder_gan.pt", budget_s=budget, log=log)
            made["hift"] = hift
            return info["steps_done"], info["finished"], {**info["last_losses"],
                                                          "source_weight_norm": info["source_weight_norm"],
                                                          "seconds_per_step": info["seconds_per_step"]}
        run_phase("vocoder_gan", vocoder_gan_run)
        candidate = write_candidate(args.out, args.candidate, made["hift"])
        log(f"vocoder_gan: candidate {candidate} (the shipped {args.out / 'vocoder.safetensors'} is unchanged)")

    ok = check(args.out, record, log, candidate)
    configs = {}
    for name in ("teacher", "student"):
        if (args.out / f"{name}.safetensors").is_file():
            flow = load_flow(args.out / f"{name}.safetensors")
            configs[name] = flow.config.to_dict()
            record.data.setdefault("parameters", {})[f"{name}_estimator"] = sum(
                q.numel() for q in flow.estimator.parameters())
            record.data["parameters"][name] = sum(q.numel() for q in flow.parameters())
    if (args.out / "vocoder.safetensors").is_file():
        hift = load_vocoder(args.out / "vocoder.safetensors")
        configs["vocoder"] = hift.config.to_dict()
        record.data.setdefault("parameters", {})["vocoder"] = sum(q.numel() for q in hift.parameters())
    record.data["configs"] = configs
    record.data["machine"] = {"processor": platform.processor() or platform.machine(), "torch": torch.__version__,
                              "cores": len(__import__("os").sched_getaffinity(0))}
    record.write()
    finished = [n for n in PHASES if record.phase(n)["finished"]]
    finished += [n for n in EXTRA_PHASES if record.data["phases"].get(n, {}).get("finished")]
    log(f"total: {time.perf_counter() - t_all:.0f} s wall; phases finished: {finished}")
    return 0 if ok else 1


def check(out: Path, record: Record, log, candidate: Path | None = None) -> bool:
    """The end-of-run checks of every finished phase on three held-out sentences (module docstring); a
    candidate vocoder written by this run must make finite audio (its ESTOI is shown beside the shipped
    one's, for information: a paired evaluation on every held-out sentence decides)."""
    utts = load_heldout(out / "heldout.npz")[:3]
    ok = True
    if record.phase("teacher")["finished"]:
        flow = load_flow(out / "teacher.safetensors")
        err = np.mean([np.abs(synthesize_one(flow, u, 10, 0.7, seed=k)[0] - u.mel).mean() for k, u in enumerate(utts)])
        base = np.mean([np.abs(u.voice_mean[:, None] - u.mel).mean() for u in utts])
        good = bool(err < base)
        ok &= good
        log(f"check: teacher guided 10-step mean abs error {err:.3f} vs mean-spectrum baseline {base:.3f}: "
            f"{'ok' if good else 'FAILED'}")
    if record.phase("vocoder")["finished"]:
        hift = load_vocoder(out / "vocoder.safetensors")
        ours = np.mean([intelligibility(u.reference, vocode(hift, u.mel)).estoi for u in utts])
        gl = np.mean([intelligibility(u.reference, griffin_lim(u.mel)).estoi for u in utts])
        good = bool(ours > gl - GRIFFIN_LIM_MARGIN)
        ok &= good
        log(f"check: vocoder ESTOI on the true mel {ours:.3f} vs Griffin-Lim {gl:.3f} (at most "
            f"{GRIFFIN_LIM_MARGIN} below it): {'ok' if good else 'FAILED'}")
    if candidate is not None:
        shipped, new = load_vocoder(out / "vocoder.safetensors"), load_vocoder(candidate)
        audio = [vocode(new, u.mel) for u in utts]
        good = all(np.isfinite(a).all() for a in audio)
        ok &= good
        theirs = np.mean([intelligibility(u.reference, a).estoi for u, a in zip(utts, audio)]) if good else float("nan")
        ours = np.mean([intelligibility(u.reference, vocode(shipped, u.mel)).estoi for u in utts])
        log(f"check: candidate vocoder's audio finite: {'ok' if good else 'FAILED'}; ESTOI on {len(utts)} held-out "
            f"true mels {theirs:.3f} vs the shipped vocoder's {ours:.3f} (scripts/evaluate_small.py decides)")
    return ok


if __name__ == "__main__":
    sys.exit(main())
