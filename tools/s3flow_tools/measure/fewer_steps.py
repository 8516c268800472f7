"""What fewer Euler steps cost a stream's quality: the trained small teacher streamed in process on the held-out
sentences (the served chunk logic and defaults: bounded context, the client's chunk schedule, guidance 0.7), each
chunk at the steps a row names, its mel vocoded by the trained vocoder and scored against the recording
-> ``results/fewer_steps.md``. What ``min_steps`` (the fewest steps the deadline scheduler may give a late chunk,
``s3flow.engine.scheduler``) is chosen from.

Rows: every chunk at 10 (the stream's own steps), 8, 6 and 4 steps; only the START at fewer (the late chunk the
scheduler cuts most: it carries the prompt and is due first); every other chunk at fewer (a seam where the step
count changes at every chunk boundary, both ways). Columns: ESTOI against the recording, and its change against
every chunk at 10, paired per sentence (mean, and twice its standard error); mel error against the ground truth
and against the 10-step stream; the seams: the mean frame-to-frame change of the mel across a chunk boundary over
that within chunks (1.0: a boundary is no different from any other frame). Example::

    .venv/bin/python -m s3flow_tools.measure.fewer_steps                 # all 64 held-out sentences
    .venv/bin/python -m s3flow_tools.measure.fewer_steps --max-utterances 8 --out /tmp/f.md
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from s3flow_client import chunk_schedule
from s3flow_contract.tensors import request_arrays
from s3flow.engine.settings import SolverSettings
from s3flow.engine.streaming import StreamingEngine
from s3flow.model.checkpoint import load_flow
from s3flow.model.flow import TorchEstimator
from s3flow.model.vocoder import load_vocoder
from s3flow.protocol import parse_request
from s3flow.runtime.vocoder import vocode
from s3flow_training.intelligibility import intelligibility
from s3flow_training.package import HeldoutUtterance, load_heldout
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import TRAINED

ROOT = Path(__file__).resolve().parents[3]
FULL = 10
#: a row: its name and each chunk's steps from the chunk's index
Row = tuple[str, Callable[[int], int]]


def rows() -> list[Row]:
    out: list[Row] = [(f"every chunk at {k}", lambda i, k=k: k) for k in (10, 8, 6, 4)]
    out += [(f"the START at {k}, the rest at {FULL}", lambda i, k=k: k if i == 0 else FULL) for k in (6, 4)]
    out += [(f"every other chunk at {k} (from the second)", lambda i, k=k: k if i % 2 else FULL) for k in (6, 4)]
    return out


def engine_for(flow, settings: SolverSettings) -> StreamingEngine:
    def encode(tokens, token_len, embedding):
        with torch.inference_mode():
            return flow.encoder(tokens, token_len, embedding)

    return StreamingEngine(encode, TorchEstimator(flow.estimator), n_feats=flow.config.n_feats,
                           meanflow=flow.config.meanflow, solving=settings.solving, limits=settings.sequences)


def stream(engine: StreamingEngine, settings: SolverSettings, u: HeldoutUtterance, steps: Callable[[int], int],
           seed: int) -> tuple[np.ndarray, list[int]]:
    """The utterance streamed chunk by chunk, chunk i at ``steps(i)`` (sent as ``chunk_steps``, as a replay sends
    them); its mel and the frames where chunks 2, 3, ... began."""
    chunks = chunk_schedule(len(u.speech_tokens))
    mels, seams, lo = [], [], 0
    for i, n in enumerate(chunks):
        start = i == 0
        prompt = dict(prompt_tokens=u.prompt_tokens, prompt_mel=np.ascontiguousarray(u.prompt_mel.T),
                      speaker_embedding=u.xvector, seed=seed, n_timesteps=FULL) if start else {}
        arrays = request_arrays(u.speech_tokens[lo:lo + n], start=start, token_offset=lo, chunk_steps=steps(i),
                                **prompt)
        req = parse_request(arrays, start=start, end=i == len(chunks) - 1, rules=settings.rules,
                            n_feats=engine.n_feats)
        [r] = engine.run([engine.admit(1, req)])
        if i:
            seams.append(r.frame_offset)
        mels.append(r.mel)
        lo += n
    return np.concatenate(mels, axis=1), seams


def seam_ratio(mel: np.ndarray, seams: Sequence[int]) -> float:
    """Mean |frame f - frame f-1| at the chunk boundaries over the same within chunks."""
    step = np.abs(np.diff(mel, axis=1)).mean(axis=0)      # step[f - 1]: between frames f-1 and f
    at = np.zeros(step.size, bool)
    at[[s - 1 for s in seams if 0 < s <= step.size]] = True
    return float(step[at].mean() / step[~at].mean()) if at.any() else float("nan")


@dataclass
class Result:
    name: str
    estoi: np.ndarray          # per sentence
    mel_gt: float
    mel_full: float
    seams: float


def measure(teacher, hift, utts: Sequence[HeldoutUtterance], log=print) -> list[Result]:
    settings = SolverSettings()
    engine = engine_for(teacher, settings)
    out, full_mels = [], None
    for name, steps in rows():
        mels, ratios = [], []
        for k, u in enumerate(utts):
            mel, seams = stream(engine, settings, u, steps, seed=k)
            mels.append(mel)
            ratios.append(seam_ratio(mel, seams))
        if full_mels is None:
            full_mels = mels
        estoi = np.array([intelligibility(u.reference, vocode(hift, m)).estoi for u, m in zip(utts, mels)])
        out.append(Result(name, estoi, float(np.mean([np.abs(m - u.mel).mean() for m, u in zip(mels, utts)])),
                          float(np.mean([np.abs(m - f).mean() for m, f in zip(mels, full_mels)])),
                          float(np.nanmean(ratios))))
        log(f"{name}: ESTOI {estoi.mean():.3f}", flush=True)
    return out


def report(results: list[Result], n: int, seconds: float) -> str:
    base = results[0].estoi
    lines = ["# Fewer Euler steps: what they cost a stream", "",
             f"`python -m s3flow_tools.measure.fewer_steps` ({time.strftime('%Y-%m-%d')}, {platform.machine()}, "
             f"{seconds:.0f} s): the trained small teacher (guided 0.7, its own 10 cosine steps) streamed in process "
             f"with the served defaults (bounded context, the client's chunk schedule 10/20/40/80/100 tokens) on "
             f"{n} held-out sentences, each chunk at the steps the row names (a cosine grid of its own, what the "
             f"deadline scheduler gives a late chunk), vocoded by the trained vocoder, scored against the "
             f"recording. ESTOI change: paired per sentence against every chunk at 10 (mean +- twice its standard "
             f"error). Seams: frame-to-frame change across a chunk boundary over that within chunks.", "",
             "| chunks' steps | ESTOI | ESTOI change | mel error vs truth | mel error vs 10 steps | seams |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        d = r.estoi - base
        se = 2 * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
        change = "" if r is results[0] else f"{d.mean():+.4f} +- {se:.4f}"
        lines.append(f"| {r.name} | {r.estoi.mean():.3f} | {change} | {r.mel_gt:.3f} | {r.mel_full:.3f} | "
                     f"{r.seams:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--trained", type=Path, default=TRAINED, help="the shipped files (default: %(default)s)")
    p.add_argument("--max-utterances", type=int, default=0, help="0: every held-out sentence (default)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "fewer_steps.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    teacher, hift = load_flow(args.trained / "teacher.safetensors"), load_vocoder(args.trained / "vocoder.safetensors")
    utts = load_heldout(args.trained / "heldout.npz")
    utts = utts[:args.max_utterances] if args.max_utterances else utts
    results = measure(teacher, hift, utts)
    text = report(results, len(utts), time.perf_counter() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
