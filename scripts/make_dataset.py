#!/usr/bin/env python3
"""Make the small training corpus: espeak-ng speech -> 24 kHz S3Gen log-mel -> k-means speech tokens.

Examples::

    .venv/bin/python scripts/make_dataset.py                          # build/small_data/dataset.npz
    .venv/bin/python scripts/make_dataset.py --sentences 40 --out /tmp/tiny.npz

Needs the ``espeak-ng`` program (Debian: apt-get install -y espeak-ng; ``make train`` installs it).
See ``s3flow_training.data`` for what is made and how. Prints the corpus' size and split and checks
it (token ids below 6561, 2 mel frames per token, finite mel, both splits present); exits non-zero on
any failure.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from s3flow_contract.tensors import TOKENS_PER_SECOND
from s3flow_training.data import VOCAB_SIZE, DataSettings, Dataset, build_dataset, espeak_available

DEFAULT_OUT = ROOT / "build" / "small_data" / "dataset.npz"


def check(ds: Dataset) -> list[str]:
    """Problems found in a corpus (empty when it is fine)."""
    problems = []
    for i, u in enumerate(ds.utterances):
        if u.mel.shape[1] != 2 * u.n_tokens:
            problems.append(f"utterance {i}: {u.mel.shape[1]} mel frames for {u.n_tokens} tokens")
        if u.tokens.min() < 0 or u.tokens.max() >= VOCAB_SIZE:
            problems.append(f"utterance {i}: token ids outside [0, {VOCAB_SIZE})")
        if not np.isfinite(u.mel).all():
            problems.append(f"utterance {i}: non-finite mel")
    if not ds.split(heldout=True) or not ds.split(heldout=False):
        problems.append("a split is empty")
    return problems


def make(settings: DataSettings, out: Path, log=print) -> Dataset:
    t0 = time.perf_counter()
    ds = build_dataset(settings, log=log)
    ds.save(out)
    train, held = ds.split(heldout=False), ds.split(heldout=True)
    secs = lambda idx: sum(ds.utterances[i].n_tokens for i in idx) / TOKENS_PER_SECOND  # noqa: E731
    log(f"wrote {out}: {len(train)} training utterances ({secs(train):.0f} s), {len(held)} held-out "
        f"({secs(held):.0f} s, sentences never seen in training), {len(ds.xvectors)} voices, "
        f"in {time.perf_counter() - t0:.0f} s")
    return ds


def main(argv=None) -> int:
    d = DataSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="(default: %(default)s)")
    p.add_argument("--sentences", type=int, default=d.n_sentences, help="(default: %(default)s)")
    p.add_argument("--voices-per-sentence", type=int, default=d.voices_per_sentence, help="(default: %(default)s)")
    p.add_argument("--codebook-size", type=int, default=d.codebook_size, help="(default: %(default)s)")
    p.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    args = p.parse_args(argv)
    if not espeak_available():
        print("error: espeak-ng not found; install it with `apt-get install -y espeak-ng` or run `make train`",
              file=sys.stderr)
        return 1
    settings = DataSettings(n_sentences=args.sentences, voices_per_sentence=args.voices_per_sentence,
                            codebook_size=args.codebook_size, heldout_fraction=args.heldout_fraction,
                            seed=args.seed)
    make(settings, args.out)
    problems = check(Dataset.load(args.out))
    for line in problems:
        print("error:", line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
