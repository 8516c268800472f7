"""Seeded stand-in inputs (random tokens, prompt and x-vector) for demos and tests; numpy only."""
from __future__ import annotations

from typing import Optional

import numpy as np

from s3flow_contract.tensors import TOKENS_PER_SECOND, VOCAB_SIZE, XVECTOR_DIM

from .stream import Utterance, chunk_schedule


def demo_utterance(seconds: float = 5.0, *, seed: int = 0, prompt_seconds: float = 1.0,
                   n_feats: int = 80, noise_seed: int = 0) -> Utterance:
    """An utterance of ``seconds`` of speech tokens (25/s) with a ``prompt_seconds`` speaker prompt.

    Token ids, the prompt mel (log-mel-like values around -6..0) and the x-vector come from ``seed``;
    ``noise_seed`` is the server-side noise seed.
    """
    rng = np.random.default_rng(seed)
    n, np_ = max(1, round(TOKENS_PER_SECOND * seconds)), max(1, round(TOKENS_PER_SECOND * prompt_seconds))
    mel = (-3.0 + 1.5 * rng.standard_normal((2 * np_, n_feats))).astype(np.float32)
    return Utterance(speech_tokens=rng.integers(0, VOCAB_SIZE, n, dtype=np.int64),
                     prompt_tokens=rng.integers(0, VOCAB_SIZE, np_, dtype=np.int64),
                     prompt_mel=mel,
                     speaker_embedding=rng.standard_normal(XVECTOR_DIM).astype(np.float32),
                     seed=noise_seed)


def demo_utterances(n: int, seconds: float, *, chunk: int = 10, steps: Optional[int] = None,
                    seed: int = 0) -> list[Utterance]:
    """``n`` utterances of ``seconds`` each in equal chunks of ``chunk`` tokens: utterance i's tokens, prompt and
    x-vector from ``seed + i``, its noise seed i."""
    out = []
    for i in range(n):
        u = demo_utterance(seconds, seed=seed + i, noise_seed=i)
        u.chunks, u.n_timesteps = chunk_schedule(len(u.speech_tokens), chunk, 1.0, chunk), steps
        out.append(u)
    return out


def load_utterance(path, noise_seed: int = 0) -> Utterance:
    """An utterance from an .npz in flow_infer's format (speech_tokens (1, N), prompt_tokens (1, Np),
    prompt_feat (1, 2 Np, 80), embedding (1, 192))."""
    d = np.load(path)
    return Utterance(speech_tokens=d["speech_tokens"].reshape(-1).astype(np.int64),
                     prompt_tokens=d["prompt_tokens"].reshape(-1).astype(np.int64),
                     prompt_mel=d["prompt_feat"][0].astype(np.float32),
                     speaker_embedding=d["embedding"].reshape(-1).astype(np.float32), seed=noise_seed)


def load_truth(path) -> "np.ndarray | None":
    """The ground-truth mel (n_feats, 2 N) an input .npz may carry as ``mel`` (1, n_feats, 2 N), else None
    (the trained model's held-out files carry it)."""
    with np.load(path) as d:
        return d["mel"][0].astype(np.float32) if "mel" in d.files else None
