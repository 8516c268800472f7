#!/usr/bin/env python3
"""Measure the small trained models on held-out speech: intelligibility against the recordings, mel errors,
streamed vs offline; write results/small_model.md, its picture and a few wavs.

Examples::

    .venv/bin/python scripts/evaluate_small.py                          # after scripts/train_small.py
    .venv/bin/python scripts/evaluate_small.py --max-utterances 8 --out /tmp/small_model.md --no-served
    # a candidate folder (same file names; what it lacks comes from --trained) beside the shipped models
    .venv/bin/python scripts/evaluate_small.py --candidate build/candidate --out out/candidate/small_model.md

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

With ``--candidate DIR``, every row that depends on a model is measured for both folders in the same run, on
the same sentences with the same seeds (the served rows on a repository built from each folder's own files),
and section "Candidate vs shipped" compares them per held-out sentence: for STOI, ESTOI, the log-spectral
distance and the mel error, the mean of candidate - shipped, its 95 % t-interval, the same mean with every
noise seed changed (seeds 10,000 + i), the seed spread (how far the mean moved) and a verdict (``candidate
better`` / ``candidate worse`` only where the interval excludes 0 and the difference exceeds the seed spread,
else ``no difference``). The per-sentence values go to ``<out stem>_paired.json``
(``s3flow_training.evaluate.paired_from_json`` reads them back).

Exits non-zero when a claim fails (on the shipped models; a verdict never changes the exit status): the
2-step student must be closer to teacher-10 than the teacher cut to 2 steps; the vocoder on the true mel must
be within ``GRIFFIN_LIM_MARGIN`` (0.1) of Griffin-Lim's ESTOI (the small vocoder's ceiling is below it).
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
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
from s3flow.model.flow import S3Flow
from s3flow_client.audio import write_wav
from s3flow.model.vocoder import HiFTGenerator, load_vocoder
from s3flow.runtime.vocoder import vocode
from s3flow_training.evaluate import (BETTER, METHODS, NO_DIFFERENCE, WORSE, PairedMetric, evaluate_methods,
                                      paired_to_json, stream_vs_offline, synthesize_one)
from s3flow_training.intelligibility import (RATE, griffin_lim, intelligibility, log_spectral_distance,
                                             to_16k)
from s3flow_training.package import HeldoutUtterance, load_demo_input, load_heldout
from s3flow_training.vocoder_train import GRIFFIN_LIM_MARGIN

TRAINED = ROOT / "checkpoints" / "trained"


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


#: The other seeds: sentence k's noise seeds become RESEED + seed base + k (see ``offline_outputs``).
RESEED = 10_000
#: The files of a model folder (``--trained``, ``--candidate``), by the part they hold.
MODEL_FILES = {"teacher": "teacher.safetensors", "student": "student.safetensors", "vocoder": "vocoder.safetensors"}
#: Files that say which sentences are measured: always ``--trained``'s (pairing needs the same sentences).
DATA_FILES = ("heldout.npz", "outside.npz", "demo_utt.npz")


@dataclass(frozen=True)
class AudioRow:
    """One row of the intelligibility table; ``folder_free``: the same audio whichever models are measured."""
    key: str
    name: str
    folder_free: bool = False


ROWS: tuple[AudioRow, ...] = (
    AudioRow("griffin_lim_true_mel", "Griffin-Lim (64 iterations) of the true mel", folder_free=True),
    AudioRow("vocoder_true_mel", "trained vocoder on the true mel (its ceiling)"),
    AudioRow("teacher10_griffin_lim", "teacher, guided 10 steps, offline, Griffin-Lim"),
    AudioRow("teacher10_vocoder", "teacher, guided 10 steps, offline, vocoder"),
    AudioRow("student2_vocoder", "student, 2 steps, offline, vocoder"),
    AudioRow("teacher10_streamed", "teacher, guided 10 steps, **streamed through tritonserver** (token2wav)"),
    AudioRow("student2_streamed", "student, 2 steps, streamed through tritonserver"),
    AudioRow("student1_streamed", "student, 1 step, streamed through tritonserver"),
    AudioRow("white_noise", "white noise (the floor)", folder_free=True),
)
ROW = {r.key: r for r in ROWS}
OFFLINE_ROWS = ("vocoder_true_mel", "teacher10_griffin_lim", "teacher10_vocoder", "student2_vocoder")
#: The served rows: (model, Euler steps) each.
SERVED_ROWS = {"teacher10_streamed": ("teacher", 10), "student2_streamed": ("student", 2),
               "student1_streamed": ("student", 1)}
SHIPPED, CANDIDATE = "shipped", "candidate"


@dataclass
class Models:
    """One folder's networks; ``files``: the file each came from (``teacher``, ``student``, ``vocoder``)."""
    label: str              # SHIPPED or CANDIDATE
    folder: Path
    files: dict
    teacher: S3Flow
    student: S3Flow
    hift: HiFTGenerator

    def prefix(self, name: str) -> str:
        """A row name as this folder's table rows show it (the shipped rows keep their names)."""
        return name if self.label == SHIPPED else f"{self.label}: {name}"


def load_models(label: str, folder: Path, fallback: Optional[Path] = None) -> Models:
    """The teacher, student and vocoder of ``folder``; a file it lacks comes from ``fallback``."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{label} folder not found: {folder}")
    files = {}
    for part, name in MODEL_FILES.items():
        path = folder / name
        if not path.is_file() and fallback is not None:
            path = fallback / name
        if not path.is_file():
            raise FileNotFoundError(f"{label}: {name} is in neither {folder}" +
                                    (f" nor {fallback}" if fallback is not None else ""))
        files[part] = path
    teacher, student = load_flow(files["teacher"]), load_flow(files["student"])
    if teacher.config.meanflow or not student.config.meanflow:
        raise ValueError(f"{label}: {files['teacher'].name} must be a regular checkpoint and "
                         f"{files['student'].name} a meanflow one ({files['teacher']}, {files['student']})")
    return Models(label, folder, files, teacher, student, load_vocoder(files["vocoder"]))


@dataclass
class Scores:
    """One row over a set of utterances (audio at 24 kHz against the 16 kHz recordings): the per-sentence
    values and their means."""
    row: AudioRow
    name: str
    stoi_each: tuple
    estoi_each: tuple
    lsd_each: tuple
    mel_each: Optional[tuple] = None    # mean |mel - ground truth| where the audio came from a generated mel
    folder: str = ""                    # SHIPPED, CANDIDATE, or "" for a folder-free row

    @property
    def stoi(self) -> float:
        return float(np.mean(self.stoi_each))

    @property
    def estoi(self) -> float:
        return float(np.mean(self.estoi_each))

    @property
    def lsd_db(self) -> float:
        return float(np.mean(self.lsd_each))

    @property
    def mel_mae(self) -> Optional[float]:
        return None if self.mel_each is None else float(np.mean(self.mel_each))


#: (recording digest, audio digest) -> (STOI, ESTOI, log-spectral distance): pystoi's ESTOI of the same two
#: arrays varies in its last bit from call to call (its sums follow the arrays' memory alignment), so the same
#: audio from two folders is scored once and their paired difference is exactly 0.
_SCORED: dict[tuple[bytes, bytes], tuple[float, float, float]] = {}


def _digest(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a)
    return hashlib.sha1(str((a.dtype, a.shape)).encode() + a.tobytes()).digest()


def scores_of(reference: np.ndarray, audio: np.ndarray) -> tuple[float, float, float]:
    """(STOI, ESTOI, log-spectral distance) of ``audio`` (24 kHz) against ``reference`` (16 kHz)."""
    key = (_digest(reference), _digest(audio))
    if key not in _SCORED:
        s = intelligibility(reference, audio)
        _SCORED[key] = (s.stoi, s.estoi, log_spectral_distance(reference, audio))
    return _SCORED[key]


def score(row: AudioRow, utts: Sequence[HeldoutUtterance], audio: Sequence[np.ndarray],
          mels: Optional[Sequence[np.ndarray]] = None, models: Optional[Models] = None) -> Scores:
    stoi, estoi, lsd = zip(*(scores_of(u.reference, a) for u, a in zip(utts, audio)))
    mae = None if mels is None else tuple(float(np.abs(m - u.mel).mean()) for m, u in zip(mels, utts))
    return Scores(row, row.name if models is None else models.prefix(row.name), stoi, estoi, lsd, mae,
                  "" if models is None else models.label)


def folder_free_scores(utts: Sequence[HeldoutUtterance]) -> dict[str, Scores]:
    """Griffin-Lim of the true mel and white noise (the floor)."""
    noise = [0.05 * np.random.default_rng(k).standard_normal(len(u.reference) * 3 // 2).astype(np.float32)
             for k, u in enumerate(utts)]
    return {"griffin_lim_true_mel": score(ROW["griffin_lim_true_mel"], utts, [griffin_lim(u.mel) for u in utts]),
            "white_noise": score(ROW["white_noise"], utts, noise)}


def offline_outputs(models: Models, utts: Sequence[HeldoutUtterance], keys: Sequence[str] = OFFLINE_ROWS,
                    seed_base: int = 0, reseed: int = 0) -> dict[str, tuple[list, Optional[list]]]:
    """{row key: (audio (480 T,) per sentence, the mel (80, T) behind it or None)} of the offline rows ``keys``.

    Sentence k's seeds: the flow's noise ``FrameNoise(seed_base + reseed + k)``; the vocoder's NSF source and
    Griffin-Lim's initial phase 0 at the table's seeds (``reseed`` 0, as the table always had) and
    ``seed_base + reseed + k`` otherwise.
    """
    unknown = set(keys) - set(OFFLINE_ROWS)
    if unknown:
        raise ValueError(f"not offline rows: {sorted(unknown)} (offline: {OFFLINE_ROWS})")

    def flow_seed(k: int) -> int:
        return seed_base + reseed + k

    def other_seed(k: int) -> int:
        return seed_base + reseed + k if reseed else 0

    out = {}
    if "vocoder_true_mel" in keys:
        out["vocoder_true_mel"] = ([vocode(models.hift, u.mel, seed=other_seed(k)) for k, u in enumerate(utts)],
                                   None)
    if {"teacher10_griffin_lim", "teacher10_vocoder"} & set(keys):
        t10 = [synthesize_one(models.teacher, u, 10, 0.7, seed=flow_seed(k))[0] for k, u in enumerate(utts)]
        if "teacher10_griffin_lim" in keys:
            out["teacher10_griffin_lim"] = ([griffin_lim(m, seed=other_seed(k)) for k, m in enumerate(t10)], t10)
        if "teacher10_vocoder" in keys:
            out["teacher10_vocoder"] = ([vocode(models.hift, m, seed=other_seed(k)) for k, m in enumerate(t10)],
                                        t10)
    if "student2_vocoder" in keys:
        s2 = [synthesize_one(models.student, u, 2, None, seed=flow_seed(k))[0] for k, u in enumerate(utts)]
        out["student2_vocoder"] = ([vocode(models.hift, m, seed=other_seed(k)) for k, m in enumerate(s2)], s2)
    return out


def served_streams(checkpoint: Path, vocoder: Path, plays: Sequence[tuple[str, Sequence[HeldoutUtterance], int]],
                   steps: Sequence[int], workdir: Path) -> dict[tuple[str, int, int], list]:
    """Stream utterances through token2wav of a real tritonserver serving a repository built from
    ``checkpoint`` and ``vocoder`` (the repository's defaults: bounded context, the cpu target), once per entry
    of ``steps``. ``plays``: (name, utterances, seed offset), utterance k streamed with seed offset + k.
    Returns {(name, seed offset, steps): [(mel, audio)]}."""
    from s3flow.repository import cli as build_repository
    from s3flow.server.triton_server import TritonServer
    from s3flow_client import StreamingClient, Utterance

    repo = workdir / "repo"
    if build_repository.main(["--checkpoint", str(checkpoint), "--vocoder-checkpoint", str(vocoder),
                              "--output", str(repo), "--no-voice"]) != 0:
        raise SystemExit(f"building the repository for {checkpoint} failed")
    out = {}
    with TritonServer(repo, log_file=workdir / "server.log") as server:
        client = StreamingClient(server.grpc_url, model="token2wav", timeout_s=600)
        for n in steps:
            for name, utts, offset in plays:
                results = []
                for k, u in enumerate(utts):   # one at a time: each stream alone, as a listener gets it
                    [r] = client.synthesize([Utterance(u.speech_tokens, u.prompt_tokens,
                                                       np.ascontiguousarray(u.prompt_mel.T), u.xvector,
                                                       seed=offset + k, n_timesteps=n)])
                    results.append((r.mel, r.audio))
                out[(name, offset, n)] = results
    return out


def served_outputs(models: Models, plays: Sequence[tuple[str, Sequence[HeldoutUtterance], int]],
                   workdir: Path) -> dict[tuple[str, int], dict[str, tuple[list, list]]]:
    """The served rows of one folder: a repository built from its teacher (its student) and its vocoder.
    Returns {(name, seed offset): {row key: (audio per sentence, mel per sentence)}}."""
    out: dict = {}
    for model in ("teacher", "student"):
        rows = {key: n for key, (m, n) in SERVED_ROWS.items() if m == model}
        folder = workdir / f"{models.label}_{model}"
        got = served_streams(models.files[model], models.files["vocoder"], plays, sorted(set(rows.values()),
                                                                                          reverse=True), folder)
        for name, _, offset in plays:
            for key, n in rows.items():
                results = got[(name, offset, n)]
                out.setdefault((name, offset), {})[key] = ([a for _, a in results], [m for m, _ in results])
    return {k: {key: v[key] for key in SERVED_ROWS if key in v} for k, v in out.items()}


def measure_folder(models: Models, utts: Sequence[HeldoutUtterance], served: dict, seed_base: int = 0,
                   reseed: int = 0, keys: Sequence[str] = OFFLINE_ROWS) -> tuple[dict[str, Scores], dict[str, list]]:
    """The model rows of one folder on ``utts``: the offline rows ``keys`` and the served ones (``served``:
    their outputs, {} for none). Returns ({row key: Scores}, {row key: the first three sentences' audio})."""
    outputs = offline_outputs(models, utts, keys, seed_base=seed_base, reseed=reseed)
    outputs.update(served)
    scores = {key: score(ROW[key], utts, audio, mels, models) for key, (audio, mels) in outputs.items()}
    return scores, {key: audio[:3] for key, (audio, _) in outputs.items()}


def table_rows(free: dict[str, Scores], folders: Sequence[dict[str, Scores]]) -> list[Scores]:
    """The intelligibility table: ``ROWS`` in order, each model row once per folder (shipped first)."""
    rows = []
    for row in ROWS:
        if row.folder_free:
            rows.append(free[row.key])
        else:
            rows += [scores[row.key] for scores in folders if row.key in scores]
    return rows


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


PAIRED_METRICS = (("STOI", "stoi_each", True), ("ESTOI", "estoi_each", True),
                  ("log-spectral distance (dB)", "lsd_each", False), ("mel error vs truth", "mel_each", False))


def paired_metrics(shipped: dict[str, Scores], candidate: dict[str, Scores], shipped_reseeded: dict[str, Scores],
                   candidate_reseeded: dict[str, Scores]) -> list[PairedMetric]:
    """Per row present in all four (``ROWS`` order) and per metric it has: the two folders' per-sentence
    values at the table's seeds and at the other seeds."""
    out = []
    for row in ROWS:
        got = [d.get(row.key) for d in (shipped, candidate, shipped_reseeded, candidate_reseeded)]
        if any(g is None for g in got):
            continue
        for metric, attr, higher in PAIRED_METRICS:
            values = [getattr(g, attr) for g in got]
            if all(v is not None for v in values):
                out.append(PairedMetric(row.name, metric, higher, *values))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trained", type=Path, default=TRAINED, help="the shipped files (default: %(default)s)")
    p.add_argument("--candidate", type=Path, help="a folder of new models with --trained's file names (a file it "
                   "lacks comes from --trained): every row that depends on a model is measured for both on the "
                   "same sentences and seeds and compared per sentence (section \"Candidate vs shipped\"; "
                   "per-sentence values in <out>_paired.json)")
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
    try:
        folders = [load_models(SHIPPED, tr)]
        if args.candidate is not None:
            folders.append(load_models(CANDIDATE, args.candidate, fallback=tr))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    shipped = folders[0]
    for models in folders[1:]:
        print(f"{models.label} {rel(models.folder)}: " + ", ".join(f"{part} {rel(path)}"
                                                                    for part, path in models.files.items()))
        for name in DATA_FILES:
            if (models.folder / name).is_file() and not filecmp.cmp(models.folder / name, tr / name, shallow=False):
                print(f"note: {rel(models.folder / name)} differs from {rel(tr / name)}; the sentences are "
                      f"{rel(tr)}'s (both folders are measured on the same ones)")
    heldout = load_heldout(tr / "heldout.npz")
    outside = load_heldout(tr / "outside.npz")
    if args.max_utterances:
        heldout, outside = heldout[:args.max_utterances], outside[:max(2, args.max_utterances // 4)]
    seconds = sum(u.frames for u in heldout) / FRAMES_PER_SECOND
    print(f"{len(heldout)} held-out utterances ({seconds:.0f} s), {len(outside)} outside the corpus", flush=True)
    # the other seeds: only to judge a candidate, on the held-out set
    reseeds = (0, RESEED) if len(folders) > 1 else (0,)
    sets = {"heldout": (heldout, 0, reseeds), "outside": (outside, 1000, (0,))}

    served: dict = {m.label: {} for m in folders}
    if args.served:
        with tempfile.TemporaryDirectory() as tmp:
            for models in folders:
                plays = [(name, utts, r) for name, (utts, _, rs) in sets.items() for r in rs]
                served[models.label] = served_outputs(models, plays, Path(tmp))
                print(f"streamed through tritonserver: {models.label} ({rel(models.folder)})", flush=True)
    measured, examples = {}, {}
    for name, (utts, seed_base, rs) in sets.items():
        for models in folders:
            for r in rs:   # (pop: the served audio is let go once scored)
                measured[(name, models.label, r)], first = measure_folder(
                    models, utts, served[models.label].pop((name, r), {}), seed_base=seed_base, reseed=r)
                if (name, r) == ("heldout", 0):
                    examples[models.label] = first
    free = {name: folder_free_scores(utts) for name, (utts, _, _) in sets.items()}
    tables = {name: table_rows(free[name], [measured[(name, m.label, 0)] for m in folders]) for name in sets}
    print("intelligibility measured", flush=True)

    n_el = sum(u.frames for u in heldout) * heldout[0].mel.shape[0]
    base = sum(np.abs(u.voice_mean[:, None] - u.mel).sum() for u in heldout) / n_el
    results, spreads, streams = {}, {}, []
    stream_utts = heldout[:args.stream_utterances]
    for models in folders:
        results[models.label], outputs = evaluate_methods(models.teacher, models.student, heldout)
        # teacher-10 from another noise seed (the seeds of offline_outputs(reseed=RESEED) on the held-out set)
        other = [synthesize_one(models.teacher, u, 10, 0.7, seed=RESEED + k)[0] for k, u in enumerate(heldout)]
        spreads[models.label] = sum(np.abs(o - r).sum() for o, r in zip(other, outputs[METHODS[0].name])) / n_el
        for flow, name in ((models.teacher, "teacher, guided, 10 steps"), (models.student, "student, 2 steps")):
            streams.append(stream_vs_offline(flow, stream_utts, models.prefix(name)))

    demo = load_demo_input(tr / "demo_utt.npz")
    panels = [("ground truth", demo.mel)]
    for name, flow, steps, rate in [("teacher, guided, 10 steps", shipped.teacher, 10, 0.7),
                                    ("teacher, guided, 2 steps", shipped.teacher, 2, 0.7),
                                    ("student (meanflow), 2 steps", shipped.student, 2, None)]:
        mel, _ = synthesize_one(flow, demo, steps, rate, seed=0)
        panels.append((f"{name}: mean abs error vs ground truth {np.abs(mel - demo.mel).mean():.3f}", mel))
    png = args.out.with_suffix(".png")
    picture(demo, panels, png)
    wav_dir = args.out.parent / f"{args.out.stem}_wavs"
    wavs = write_examples(wav_dir, heldout, folders, examples)

    paired, paired_path = [], None
    if len(folders) > 1:
        paired = paired_metrics(*(measured[("heldout", label, r)] for r in reseeds for label in (SHIPPED, CANDIDATE)))
        paired_path = args.out.with_name(f"{args.out.stem}_paired.json")
        write_paired_json(paired_path, folders, heldout, paired)
    infos = {m.label: json.loads((m.folder / "training.json").read_text()) if (m.folder / "training.json").is_file()
             else {} for m in folders}
    write_report(args, tables, results, spreads, base, streams, infos, heldout, outside, seconds, png, wavs,
                 time.perf_counter() - t_start, folders=folders, paired=paired, paired_path=paired_path)
    print(args.out.read_text())
    if paired:
        verdicts = [m.summary().verdict for m in paired]
        print(f"candidate vs shipped: {', '.join(f'{verdicts.count(v)} {v}' for v in (BETTER, WORSE, NO_DIFFERENCE))}"
              f" (of {len(paired)} row metrics; per sentence: {rel(paired_path)})")

    ok = True
    student2 = next(r for r in results[SHIPPED] if r.method.model == "student" and r.method.n_steps == 2)
    teacher2 = next(r for r in results[SHIPPED] if r.method.model == "teacher" and r.method.n_steps == 2)
    if not student2.mae_ref < teacher2.mae_ref:
        print("FAILED: the 2-step student is not closer to the guided 10-step teacher than the 2-step teacher",
              file=sys.stderr)
        ok = False
    gl, voc = tables["heldout"][0], tables["heldout"][1]
    if not voc.estoi > gl.estoi - GRIFFIN_LIM_MARGIN:
        print(f"FAILED: the vocoder's ESTOI on the true mel ({voc.estoi:.3f}) is more than {GRIFFIN_LIM_MARGIN} below "
              f"Griffin-Lim's ({gl.estoi:.3f})", file=sys.stderr)
        ok = False
    return 0 if ok else 1


def write_examples(folder: Path, utts: Sequence[HeldoutUtterance], folders: Sequence[Models], examples: dict,
                   n: int = 3) -> list[str]:
    """wavs (16 kHz) of the first ``n`` held-out utterances: recording, vocoder on the true mel, streamed;
    a candidate's as ``<k>_candidate_<kind>.wav``."""
    names = []
    for k, u in enumerate(utts[:n]):
        items = [("recording", u.reference, RATE)]
        for models in folders:
            prefix = "" if models.label == SHIPPED else f"{models.label}_"
            got = examples[models.label]
            for key in ("vocoder_true_mel", "teacher10_streamed", "student2_streamed"):
                if key in got:
                    items.append((prefix + key, got[key][k], 24000))
        for name, audio, rate in items:
            path = folder / f"{k}_{name}.wav"
            write_wav(path, to_16k(audio, rate), RATE)
            names.append(path.name)
    return names


def write_paired_json(path: Path, folders: Sequence[Models], utts: Sequence[HeldoutUtterance],
                      paired: Sequence[PairedMetric]) -> None:
    """The paired comparison's per-sentence values (``s3flow_training.evaluate.paired_from_json`` reads
    ``metrics`` back)."""
    doc = {"what": "candidate vs shipped on the held-out sentences, per sentence (scripts/evaluate_small.py)",
           "date": time.strftime("%Y-%m-%d"),
           "folders": {m.label: {"folder": rel(m.folder), "files": {k: rel(v) for k, v in m.files.items()}}
                       for m in folders},
           "seeds": SEEDS_TEXT,
           "sentences": [{"index": k, "text": u.text, "voice": u.voice, "frames": u.frames} for k, u in enumerate(utts)],
           "metrics": paired_to_json(paired)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


SEEDS_TEXT = (f"sentence i (0-based) at the table's seeds: the flow's noise FrameNoise(i), the vocoder's NSF "
              f"source seed 0, Griffin-Lim's initial phase seed 0, a served stream's seed i; at the other seeds "
              f"every one of them {RESEED:,} + i, for both folders alike")


def paired_section(folders: Sequence[Models], paired: Sequence[PairedMetric], n: int, json_name: str) -> list[str]:
    """The "Candidate vs shipped" section's lines."""
    shipped, candidate = folders
    own = [p.name for p in candidate.files.values() if p.parent.resolve() == candidate.folder.resolve()]
    taken = [p.name for p in candidate.files.values() if p.parent.resolve() != candidate.folder.resolve()]
    L = ["## Candidate vs shipped\n"]
    L.append(f"Shipped: `{rel(shipped.folder)}`. Candidate: `{rel(candidate.folder)}` "
             f"({', '.join(own) if own else 'no model file of its own'}"
             f"{'; ' + ', '.join(taken) + ' taken from `' + rel(shipped.folder) + '`' if taken else ''}). Both "
             f"measured in this run on the same {n} held-out sentences with the same seeds; every row of the "
             f"intelligibility tables that depends on a model appears for both (the candidate's as "
             f"\"candidate: ...\"). Per sentence i, d_i = candidate - shipped.\n")
    L.append("| audio | metric | shipped | candidate | mean d | 95 % interval of mean d | mean d, other seeds | "
             "seed spread | verdict |")
    L.append("| --- | --- | ---: | ---: | ---: | :---: | ---: | ---: | --- |")
    for m in paired:
        s = m.summary()
        lo, hi = s.interval
        interval = "" if np.isnan(lo) else f"[{lo:+.4f}, {hi:+.4f}]"
        L.append(f"| {m.row} | {m.metric} | {s.mean_shipped:.4f} | {s.mean_candidate:.4f} | "
                 f"{s.mean_difference:+.4f} | {interval} | {s.mean_difference_reseeded:+.4f} | {s.seed_spread:.4f} | "
                 f"{s.verdict} |")
    L.append("")
    L.append("- mean d: the mean over the sentences of d_i at the table's seeds (" + SEEDS_TEXT + ").")
    L.append(f"- 95 % interval: Student's t interval of mean d over the n sentences, mean d +- t(0.975, n - 1) "
             f"sd(d) / sqrt(n) (none below 2 sentences).")
    L.append("- mean d, other seeds: the same mean with every noise seed changed, for both folders alike.")
    L.append("- seed spread: |mean d, other seeds - mean d|: how far the mean paired difference moves when only "
             "the noise seeds change.")
    L.append(f"- verdict: \"{BETTER}\" where the gain (mean d for STOI and ESTOI; -mean d for the log-spectral "
             f"distance and the mel error, lower being better) is positive, the interval excludes 0 and |mean d| "
             f"exceeds the seed spread; \"{WORSE}\" the same with the gain negative; otherwise \"{NO_DIFFERENCE}\".")
    L.append(f"- Per sentence, at both seeds: [{json_name}]({json_name}).\n")
    return L


def write_report(args, tables, results, spreads, base, streams, infos, heldout, outside, seconds, png, wavs,
                 eval_s, folders, paired=(), paired_path=None) -> None:
    """``results``, ``spreads``, ``infos``: per folder label (the shipped one always)."""
    L = ["# Small trained model: vocoder, teacher (CFM, guided) and 2-step meanflow student\n",
         f"Made by `scripts/train_small.py` (training) and `scripts/evaluate_small.py` ({time.strftime('%Y-%m-%d')}, "
         f"these figures). Held-out: {len(heldout)} utterances, {seconds:.0f} s of speech "
         f"(`checkpoints/trained/heldout.npz`): sentences never seen in training, spoken by the training voices, "
         f"each with a 1.6-2.4 s prompt cut from other held-out utterances of the same voice. Outside the corpus: "
         f"{len(outside)} sentences of words and grammar the corpus never has (`outside.npz`), one per voice.\n"]
    if paired:
        L += paired_section(folders, paired, len(heldout), paired_path.name)
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
    h = {r.row.key: r for r in tables["heldout"] if r.folder in ("", SHIPPED)}
    streamed, offline, student2 = h.get("teacher10_streamed"), h["teacher10_vocoder"], h.get("student2_streamed")
    if streamed is not None:
        L.append(f"Targets (issue: the main job speaks): vocoder on the true mel ESTOI "
                 f"{h['vocoder_true_mel'].estoi:.3f} (target >= 0.80, Griffin-Lim "
                 f"{h['griffin_lim_true_mel'].estoi:.3f}); the demo's served audio "
                 f"(teacher-10 streamed) {streamed.estoi:.3f} (target >= 0.60); streamed - offline "
                 f"{streamed.estoi - offline.estoi:+.3f} (target within 0.02); student-2 streamed - teacher-10 "
                 f"streamed {student2.estoi - streamed.estoi:+.3f} (target within 0.03).\n")
    L.append(f"Listen: [{', '.join(wavs[:4])}, ...](small_model_wavs/) (16 kHz: the recording, the vocoder on the "
             f"true mel, teacher-10 and student-2 streamed, for the first three held-out sentences"
             f"{'; the candidate_*.wav: the same by the candidate' if len(folders) > 1 else ''}).\n")
    L.append("## Mel per solver\n")
    L.append("Every solver starts from the same seeded noise (`FrameNoise(seed = utterance index)`); errors in "
             "log-mel units (natural log) over all frames and 80 bins of the generated region.\n")
    L.append("| solver | mean abs error vs ground truth | MSE vs ground truth | mean abs error vs teacher-10 | "
             "MSE vs teacher-10 | detail ratio | estimator calls | network evaluations (rows) | wall time | "
             "time vs teacher-10 |")
    L.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for models in folders:
        ref = results[models.label][0]
        for r in results[models.label]:
            L.append(f"| {models.prefix(r.method.name)} | {r.mae_gt:.3f} | {r.mse_gt:.3f} | {r.mae_ref:.3f} | "
                     f"{r.mse_ref:.3f} | {r.detail_ratio:.2f} | {r.calls} | {r.evaluations} | {r.wall_s:.1f} s | "
                     f"{r.wall_s / ref.wall_s:.2f} |")
    L.append("")
    for models in folders:
        rows = results[models.label]
        ref = rows[0]
        s2 = next(r for r in rows if r.method.model == "student" and r.method.n_steps == 2)
        t2 = next(r for r in rows if r.method.model == "teacher" and r.method.n_steps == 2)
        holds = s2.mae_ref < t2.mae_ref
        L.append(f"**{models.prefix('Meanflow claim')}** (a 2-step student distilled from the guided 10-step "
                 f"teacher keeps the teacher's output where the teacher cut to 2 steps does not): "
                 f"{'holds' if holds else 'does not hold'}: the 2-step student is {s2.mae_ref:.3f} from teacher-10 "
                 f"against {t2.mae_ref:.3f} for teacher-2, at {s2.evaluations} network evaluations instead of "
                 f"{ref.evaluations}.\n")
    for models in folders:
        L.append(f"- Reference spread{'' if models.label == SHIPPED else ' (' + models.label + ')'}: teacher-10 "
                 f"from *another* noise seed is "
                 f"{spreads[models.label]:.3f} (mean abs) from the same teacher's output: the distance between two "
                 f"equally good samples.")
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
    for models in folders:
        info = infos[models.label]
        if not info.get("phases") or (models.label != SHIPPED and info == infos[SHIPPED]):
            continue
        L.append(f"## Training{'' if models.label == SHIPPED else ' of the ' + models.label} "
                 f"(from `{rel(models.folder / 'training.json')}`)\n")
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
