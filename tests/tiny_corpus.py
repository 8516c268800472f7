"""A tiny seeded corpus for the training tests: utterances whose mel is a fixed function of the tokens."""
from __future__ import annotations

import numpy as np

from s3flow_training.data import DataSettings, Dataset, Utterance, make_xvectors


def tiny_dataset(seed: int = 0, n: int = 12, vocab: int = 16, heldout: int = 2) -> Dataset:
    """``n`` utterances of 8-13 tokens, mel = a per-token table plus a little noise; 2 voices; the last
    ``heldout`` held out."""
    rng = np.random.default_rng(seed)
    table = rng.normal(-5, 2, (vocab, 80, 2)).astype(np.float32)
    stats = rng.normal(0, 1, (2, 2, 80)).astype(np.float32)
    utts = []
    for i in range(n):
        tokens = rng.integers(0, vocab, int(rng.integers(8, 14)))
        mel = np.concatenate([table[t] for t in tokens], axis=1) + 0.1 * rng.standard_normal((80, 2 * len(tokens)))
        utts.append(Utterance(f"u{i}", i % 2, tokens.astype(np.int64), mel.astype(np.float32), heldout=i >= n - heldout))
    return Dataset(utts, np.zeros((vocab, 160), np.float32), stats, make_xvectors(stats, seed), DataSettings())
