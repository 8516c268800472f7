"""The sentences the measure drivers stream: the held-out set of the small model trained here.

``checkpoints/trained`` holds the trained teacher, student and vocoder and ``heldout.npz``, the sentences training
never saw (each with its own speaker prompt and recording). The scheduling, admission, layout and projection
drivers stream the same 3-6 s ones, so that their tables compare.

Example::

    from s3flow_tools.measure.corpus import TRAINED, utterances
    utts = utterances(8)          # 8 held-out sentences of 3-6 s as client Utterances, seeds 0..7
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from s3flow_contract.tensors import TOKENS_PER_SECOND
from s3flow_client import Utterance
from s3flow_training.package import HeldoutUtterance, load_heldout

TRAINED = Path(__file__).resolve().parents[3] / "checkpoints" / "trained"


@functools.lru_cache(maxsize=1)
def heldout() -> tuple[HeldoutUtterance, ...]:
    """The held-out sentences of 3-6 s (read once per process)."""
    return tuple(u for u in load_heldout(TRAINED / "heldout.npz")
                 if 3.0 <= len(u.speech_tokens) / TOKENS_PER_SECOND <= 6.0)


def held(n: int, offset: int = 0) -> list[HeldoutUtterance]:
    """n held-out sentences of 3-6 s, from the ``offset``-th on (round the list)."""
    sentences = heldout()
    return [sentences[(offset + k) % len(sentences)] for k in range(n)]


def utterances(n: int, offset: int = 0) -> list[Utterance]:
    """``held(n, offset)`` as the client sends them, the k-th with noise seed k."""
    return [Utterance(u.speech_tokens, u.prompt_tokens, np.ascontiguousarray(u.prompt_mel.T), u.xvector, seed=k)
            for k, u in enumerate(held(n, offset))]
