"""Measuring streaming modes on a trained model: cost, chunk latency, error vs ground truth, seams.

For one utterance and one mode (offline, prefix re-run, or bounded context of C frames), ``measure``
streams it chunk by chunk through the served chunk logic (``s3flow.engine.streaming.StreamingEngine``, in
process) and reports:

* cost: estimator frames x NFE summed over chunks (``StreamingEngine.solved_frames``) and wall time;
* latency of every chunk (the first, middle and last are what the report shows);
* mel error against the ground truth;
* seam roughness: the mean frame-to-frame change at chunk seams divided by the same away from seams
  (1.0: a seam looks like any other frame boundary).

``long_utterances`` joins held-out sentences of one voice (cyclically) into 10, 30, 60 s utterances with
their ground truth, prompted by another held-out sentence of that voice.

Example::

    utts = long_utterances(load_heldout("checkpoints/trained/heldout.npz"), [10.0])
    row = measure(load_flow("checkpoints/trained/teacher.safetensors"), utts[0], context_frames=100)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from s3flow_contract.tensors import FRAMES_PER_SECOND, TOKENS_PER_SECOND
from s3flow.model.flow import S3Flow
from s3flow.engine.settings import SolverSettings
from s3flow_training.evaluate import stream_utterance, synthesize_one
from s3flow_training.package import HeldoutUtterance


@dataclass
class Measurement:
    """One utterance in one mode. context_frames: None = offline, -1 = prefix re-run, C >= 0 bounded."""
    context_frames: Optional[int]
    seconds: float
    cost_frames: int                  # estimator frames x NFE (rows; guidance's 2B batch counts once)
    wall_s: float
    chunk_latency_s: list = field(default_factory=list)
    chunk_tokens: list = field(default_factory=list)
    mae_gt: float = 0.0
    seam_roughness: float = float("nan")
    mel: Optional[np.ndarray] = None


def seam_roughness(mel: np.ndarray, seams: Sequence[int]) -> float:
    """Mean |mel[:, f] - mel[:, f - 1]| at the seam frames f, over the same at every other frame."""
    step = np.abs(np.diff(mel, axis=1)).mean(axis=0)   # step[f - 1] is the change into frame f
    at = np.zeros(step.shape[0], bool)
    for f in seams:
        if 0 < f < mel.shape[1]:
            at[f - 1] = True
    if not at.any() or at.all():
        return float("nan")
    return float(step[at].mean() / step[~at].mean())


def measure(flow: S3Flow, u: HeldoutUtterance, chunks: Sequence[int], context_frames: Optional[int],
            seed: int = 0, n_steps: Optional[int] = None) -> Measurement:
    """Offline synthesis (``context_frames`` None) or a stream of ``chunks`` in one mode."""
    steps = n_steps or (2 if flow.config.meanflow else 10)
    rate = None if flow.config.meanflow else 0.7
    if context_frames is None:
        t0 = time.perf_counter()
        mel, nfe = synthesize_one(flow, u, steps, rate, seed=seed)
        wall = time.perf_counter() - t0
        frames = u.prompt_mel.shape[1] + u.frames
        return Measurement(None, u.frames / FRAMES_PER_SECOND, frames * nfe, wall, [wall], [len(u.speech_tokens)],
                           float(np.abs(mel - u.mel).mean()), float("nan"), mel)

    settings = SolverSettings.of(context_frames=context_frames, max_utterance_frames=max(3000, u.frames),
                                 max_chunk_tokens=max(chunks))
    t0 = time.perf_counter()
    got = stream_utterance(flow, u, chunks, seed=seed, n_steps=steps, settings=settings)
    wall = time.perf_counter() - t0
    assert got.mel.shape == u.mel.shape, (got.mel.shape, u.mel.shape)
    return Measurement(context_frames, u.frames / FRAMES_PER_SECOND, got.solved_frames, wall, got.latency_s,
                       list(chunks), float(np.abs(got.mel - u.mel).mean()), seam_roughness(got.mel, got.seams),
                       got.mel)


def long_utterances(utts: Sequence[HeldoutUtterance], seconds: Sequence[float]) -> list[HeldoutUtterance]:
    """For each target length, held-out sentences of one voice joined (cyclically, in order) to at least
    that many seconds, prompted by a held-out sentence of the same voice that is not among them when one
    exists (its first 50 tokens)."""
    by_voice: dict[int, list[HeldoutUtterance]] = {}
    for u in utts:
        by_voice.setdefault(u.voice, []).append(u)
    voice = max(by_voice, key=lambda v: (len(by_voice[v]), -v))
    pool = by_voice[voice]
    prompt_src, body = (pool[0], pool[1:]) if len(pool) > 1 else (pool[0], pool)
    out = []
    for s in seconds:
        toks, mels, k = [], [], 0
        while sum(len(t) for t in toks) < TOKENS_PER_SECOND * s:
            src = body[k % len(body)]
            toks.append(src.speech_tokens)
            mels.append(src.mel)
            k += 1
        n = int(round(TOKENS_PER_SECOND * s))
        tokens, mel = np.concatenate(toks)[:n], np.concatenate(mels, axis=1)[:, :2 * n]
        np_ = min(50, len(prompt_src.speech_tokens))
        out.append(HeldoutUtterance(tokens, prompt_src.speech_tokens[:np_].copy(), prompt_src.mel[:, :2 * np_].copy(),
                                    prompt_src.xvector, mel, f"{k} held-out sentences joined", voice))
    return out
