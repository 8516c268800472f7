"""What a stream need not solve again, and what not solving it costs in quality, paired (issue 50, steps 2-4).

Examples::

    .venv/bin/python -m s3flow_tools.measure.stream_reuse                 # -> results/stream_reuse.md (~10 min)
    .venv/bin/python -m s3flow_tools.measure.stream_reuse --limit 8 --out /tmp/reuse.md

Every candidate streams the same utterances through the served chunk logic in process (``stream_utterance``:
``SolverSession`` over ``StreamingEngine``, the trained teacher guided at 10 steps, torch), from the same seed per
utterance, and is judged against **today's default** (bounded context C = 100 frames, the prompt capped at 50
frames, the client's chunk schedule 10, 20, 40, 80, 100 tokens, nothing kept) on the same utterance:

* the cheap levers: context 50 and 25 frames; the chunk schedule 10, 25, 50, 100 (grows faster);
* reuse (``keep_solved``, ``s3flow.engine.reuse``): the prompt's estimator cache kept from the first chunk (1),
  and the prompt's and the last C emitted frames' (2: every frame solved once); and the prompt's cache held by a
  registered voice (``s3flow.engine.voice_prompts``: a prompt pass of its own, read from the first chunk on; its
  frames are left out of the work, as a voice pays them once);
* today's default from another seed: the seed-to-seed spread each difference is read against;
* the same utterance in one request (one chunk: every frame once, the capped prompt): what streaming is judged
  against (its work and wall are the unit).

Utterances: the 64 held-out sentences of the trained package with their own prompts (about 2 s), then, per voice,
its longest sentence prompted with 10 s joined from its other sentences (the prompt is capped at 50 frames as
served, so the long prompt changes the encoder's input, not the estimator's). Per candidate: ESTOI of the vocoded
mel against the recording (trained vocoder), mel MAE against the ground truth, voice distance (mean over bins of
|time-mean of the mel - the voice's mean log-mel|), seam roughness (1.0: a seam looks like any frame step), and the
mean |mel - today's| (the change itself, beside the seed spread's). Paired: the mean over utterances of
(candidate - today) with its 95 % interval (1.96 standard errors).

Work: the frames each Euler step solves, summed over the stream, over the same utterance's one request (one chunk,
the same capped prompt: every frame once); wall: the stream's in-process time over that one request's, the
candidates interleaved per utterance (this host is noisy: read ratios, not seconds). A full-size table counts the
frames per Euler step from the engine's plan (``planned_calls``) for a 10 s prompt and 2 / 5 / 10 / 30 s.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from s3flow_contract.tensors import TOKENS_PER_SECOND
from s3flow.engine.planning import planned_calls
from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.vocoder import load_vocoder
from s3flow.runtime.vocoder import vocode
from s3flow_client import chunk_schedule
from s3flow_tools.bench.report import log, machine, markdown
from s3flow_tools.measure.command import command
from s3flow_tools.measure.conditioning import joined, voice_distance
from s3flow_tools.measure.corpus import TRAINED
from s3flow_training.evaluate import stream_utterance
from s3flow_training.intelligibility import intelligibility
from s3flow_training.package import HeldoutUtterance, load_heldout
from s3flow_training.streaming_eval import seam_roughness

ROOT = Path(__file__).resolve().parents[3]
STEPS = 10
LONG_PROMPT_TOKENS = 250   # 10 s


def faster_growth(n: int) -> list[int]:
    """10, 25, 50, 100, 100, ... tokens."""
    sizes, left, size = [], n, 10
    for nxt in (25, 50):
        if left <= 0:
            break
        sizes.append(min(size, left))
        left -= sizes[-1]
        size = nxt
    return sizes + (chunk_schedule(left, 50, 2.0, 100) if left > 0 else [])


@dataclass(frozen=True)
class Candidate:
    settings: dict = field(default_factory=dict)
    chunks: Callable[[int], list[int]] = chunk_schedule
    seed_offset: int = 0
    by_voice: bool = False     # started by a registered voice holding its prompt's cache


TODAY = "today: C 100, prompt 50 frames"
SPREAD = "today, another seed"
ONE = "one request (no streaming)"
CANDIDATES = {
    TODAY: Candidate(),
    SPREAD: Candidate(seed_offset=1000),
    "C 50": Candidate({"context_frames": 50}),
    "C 25": Candidate({"context_frames": 25}),
    "chunks 10, 25, 50, 100": Candidate(chunks=faster_growth),
    "prompt kept": Candidate({"keep_solved": 1}),
    "prompt kept, C 25": Candidate({"keep_solved": 1, "context_frames": 25}),
    "prompt kept, C 25, by voice": Candidate({"keep_solved": 1, "context_frames": 25, "voice_cache_mb": 64},
                                             by_voice=True),
    "every frame once (prompt and context kept)": Candidate({"keep_solved": 2}),
    "every frame once, chunks 10, 25, 50, 100": Candidate({"keep_solved": 2}, chunks=faster_growth),
}


@dataclass
class Judged:
    estoi: float
    mae: float
    voice: float
    seams: float
    change: float          # mean |mel - today's|
    frames: float          # frames solved per Euler step over the one request's
    wall: float            # stream seconds over the one request's


def utterances(heldout: Sequence[HeldoutUtterance]) -> list[HeldoutUtterance]:
    """The held-out sentences with their own prompts, then per voice its longest with a 10 s prompt."""
    out = list(heldout)
    by_voice: dict[int, list[HeldoutUtterance]] = {}
    for u in heldout:
        by_voice.setdefault(u.voice, []).append(u)
    for v in sorted(by_voice):
        pool = sorted(by_voice[v], key=lambda u: -len(u.speech_tokens))
        target, others = pool[0], pool[1:]
        pt, pm, _ = joined(others, LONG_PROMPT_TOKENS)
        out.append(HeldoutUtterance(target.speech_tokens, pt, pm, target.xvector, target.mel, target.text, v,
                                    target.voice_mean, target.reference))
    return out


def measure(teacher, hift, utts: Sequence[HeldoutUtterance], names: Sequence[str]) -> dict[str, list[Judged]]:
    rows: dict[str, list[Judged]] = {n: [] for n in names}
    rows[ONE] = []
    settings_of = {n: SolverSettings.of(**CANDIDATES[n].settings) for n in names}
    for k, u in enumerate(utts):
        n_tokens = len(u.speech_tokens)
        t0 = time.perf_counter()
        one = stream_utterance(teacher, u, [n_tokens], seed=k, n_steps=STEPS)
        one_s = time.perf_counter() - t0
        mels = {}
        rows[ONE].append(judge(one, u, hift, mels, 1.0, 1.0))
        for n in names:
            c = CANDIDATES[n]
            t0 = time.perf_counter()
            got = stream_utterance(teacher, u, c.chunks(n_tokens), seed=k + c.seed_offset, n_steps=STEPS,
                                   settings=settings_of[n], by_voice=c.by_voice)
            wall = time.perf_counter() - t0
            rows[n].append(judge(got, u, hift, mels, got.solved_frames / one.solved_frames, wall / one_s))
            mels[n] = got.mel
        rows[ONE][-1].change = float(np.abs(one.mel - mels[TODAY]).mean())
        if k % 8 == 7 or k == len(utts) - 1:
            log(f"{k + 1}/{len(utts)} utterances")
    return rows


def judge(got, u: HeldoutUtterance, hift, mels: dict, frames: float, wall: float) -> Judged:
    audio = vocode(hift, got.mel)
    return Judged(intelligibility(u.reference, audio).estoi, float(np.abs(got.mel - u.mel).mean()),
                  voice_distance(got.mel, u.voice_mean),
                  seam_roughness(got.mel, got.seams) if got.seams else float("nan"),
                  float(np.abs(got.mel - mels[TODAY]).mean()) if TODAY in mels else 0.0, frames, wall)


def paired(a: Sequence[float], b: Sequence[float]) -> str:
    d = np.asarray(a) - np.asarray(b)
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
    return f"{d.mean():+.4f} ± {half:.4f}"


def quality_table(rows: dict[str, list[Judged]]) -> str:
    today = rows[TODAY]
    header = ["candidate", "frames / one request", "wall / one request", "ESTOI", "ESTOI - today's (paired)",
              "mel MAE - today's", "voice distance - today's", "seam roughness", "mean |mel - today's|"]
    body = []
    for name, js in rows.items():
        body.append([name, f"{np.mean([j.frames for j in js]):.2f}x", f"{np.median([j.wall for j in js]):.2f}x",
                     f"{np.mean([j.estoi for j in js]):.4f}",
                     paired([j.estoi for j in js], [j.estoi for j in today]),
                     paired([j.mae for j in js], [j.mae for j in today]),
                     paired([j.voice for j in js], [j.voice for j in today]),
                     "n/a" if name == ONE else f"{np.nanmean([j.seams for j in js]):.2f}",
                     f"{np.mean([j.change for j in js]):.3f}"])
    return markdown(header, body)


def full_size_table(names: Sequence[str]) -> str:
    """Frames per Euler step from the engine's plan, 10 s prompt, over the one request's (capped prompt + every
    frame once)."""
    header = ["utterance"] + [n for n in names if n not in (SPREAD, ONE)]
    body = []
    for secs in (2, 5, 10, 30):
        n = int(TOKENS_PER_SECOND * secs)
        one = 50 + 2 * n
        row = [f"{secs} s"]
        for name in header[1:]:
            c = CANDIDATES[name]
            s = SolverSettings.of(**c.settings).solving
            calls = planned_calls(80, LONG_PROMPT_TOKENS, c.chunks(n), s.context_frames, STEPS,
                                  prompt_frames=s.prompt_frames, keep_solved=s.keep_solved, by_voice=c.by_voice)
            row.append(f"{sum(f for _, f in calls) / STEPS / one:.2f}x")
        body.append(row)
    return markdown(header, body)


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--trained", type=Path, default=TRAINED, help="(default: %(default)s)")
    p.add_argument("--limit", type=int, default=0, help="only the first N held-out sentences (and the 10 s-prompt "
                   "ones); 0: all (default)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "stream_reuse.md", help="(default: %(default)s)")
    p.add_argument("--candidate", action="append", default=[], help="a candidate's name, as many times as wanted "
                   "(today's and its seed spread always run); default: all")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    heldout = load_heldout(args.trained / "heldout.npz")
    utts = utterances(heldout)
    if args.limit:
        utts = utts[:args.limit] + utts[len(heldout):]
    teacher = load_flow(args.trained / "teacher.safetensors")
    hift = load_vocoder(args.trained / "vocoder.safetensors")
    names = list(CANDIDATES)
    if args.candidate:
        wanted = args.candidate
        unknown = [n for n in wanted if n not in CANDIDATES]
        if unknown:
            p.error(f"unknown candidates {unknown}; known: {list(CANDIDATES)}")
        names = [TODAY, SPREAD] + [n for n in wanted if n not in (TODAY, SPREAD)]
    rows = measure(teacher, hift, utts, names)
    n_long = len(utts) - (args.limit or len(heldout))
    long_only = {n: js[-n_long:] for n, js in rows.items()}
    L = ["# What a stream need not solve again: work and quality, paired", "",
         f"Written by `python -m s3flow_tools.measure.stream_reuse{f' --limit {args.limit}' if args.limit else ''}` "
         f"({time.strftime('%Y-%m-%d')}, {(time.perf_counter() - t0) / 60:.1f} min; {json.dumps(machine())}). "
         "The script's docstring says what each candidate and column is.", "",
         f"## All {len(utts)} utterances (trained teacher, guided {STEPS} steps, in process)", "",
         quality_table(rows), "",
         f"## The {n_long} with 10 s prompts", "", quality_table(long_only), "",
         "## Full size: frames per Euler step over one request's (the engine's plan, 10 s prompt, guided)", "",
         full_size_table(names), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(L))
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
