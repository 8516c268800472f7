"""What a stream keeps of its solved frames so a later chunk need not solve them again (issue 50).

Without reuse, every chunk of a bounded-context stream solves, at every Euler step, the capped prompt and up to
C context frames beside its new frames (results/stream_work.md: 2.06x the frames of one request at 5 s). A
stream may instead keep what the estimator reads of frames it solved (``s3flow.model.prefix_cache``), one cache
per Euler step and guidance half:

* ``prompt``: the prompt's frames, kept from the stream's first chunk; a later chunk solves its context and new
  frames and reads the prompt from the cache;
* ``context``: the prompt's and the last C emitted frames', each kept from the chunk that made it; a later chunk
  solves only its new frames (and the lookahead frames held back last time), so every frame is solved once, as an
  LLM's decode reads its KV cache. The emitted frames are then read as generated frames, not as conditioning
  (their mel is not in ``cond``), as in one-request synthesis.

Either way a later chunk reads the kept frames as they were when solved: they no longer attend to the frames
after them. That approximation's cost in quality is measured, paired, in results/stream_reuse.md.

A cache is of one Euler grid: a chunk solved at another step count (fewer steps given by the scheduler, a replay
naming its steps) solves the prompt and context inline as without reuse, and keeps its own cache anew. A snapshot
carries no cache: with ``prompt`` reuse it carries the tokens of the first chunk, which made the cache, and the
resumed stream solves that chunk again on a fresh state first (``s3flow.engine.step_loop``), so it reads the same
cache and goes on exactly as the undisturbed stream; with ``context`` reuse the first chunk after a resume solves
prompt and context inline and keeps anew (exact would mean solving again every chunk the context came from).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from s3flow.engine.stepping import StepCaches
from s3flow.model.prefix_cache import PrefixCache

Reuse = Literal["none", "prompt", "context"]
#: by ``ChunkSolving.keep_solved`` (0, 1, 2)
REUSE_MODES: tuple[Reuse, ...] = ("none", "prompt", "context")


@dataclass
class StreamCache:
    """A stream's kept frames: per Euler step (of a grid of ``steps``), the caches of ``prompt`` prompt frames
    followed by ``generated`` emitted frames (those just before the stream's next frame; none with ``prompt``
    reuse, whose chunks solve their context after the prompt)."""
    steps: int
    prompt: int
    generated: int
    caches: list[StepCaches]

    def extended(self, recorded: list[StepCaches], frames: int, context: int) -> "StreamCache":
        """After a chunk that read this cache and kept its first ``frames`` (emitted) frames: both joined, cut
        to the prompt and the last ``context`` emitted frames."""
        if not frames:
            return self
        caches = []
        for (c, u), (rc, ru) in zip(self.caches, recorded):
            caches.append((_keep(_join(c, rc), self.prompt, context),
                           _keep(_join(u, ru), self.prompt, context) if u is not None else None))
        return StreamCache(self.steps, self.prompt, min(context, self.generated + frames), caches)

    @staticmethod
    def made(recorded: list[StepCaches], steps: int, prompt: int, context: int) -> "StreamCache":
        """From a chunk solved inline that kept its prompt and emitted frames (the first ``prompt`` are the
        prompt's), cut to the prompt and the last ``context`` emitted frames."""
        generated = recorded[0][0].frames - prompt if recorded else 0
        caches = [(_keep(c, prompt, context), _keep(u, prompt, context) if u is not None else None)
                  for c, u in recorded]
        return StreamCache(steps, prompt, min(context, generated), caches)

    def nbytes(self) -> int:
        return sum(c.nbytes() + (u.nbytes() if u is not None else 0) for c, u in self.caches)


def _join(old: PrefixCache, new: PrefixCache) -> PrefixCache:
    """``old``'s frames then ``new``'s; the convolution tails of the later frames (``new``'s if it has any)."""
    if not new.frames:
        return old
    return PrefixCache(torch.cat([old.keys, new.keys], dim=3), torch.cat([old.values, new.values], dim=3),
                       new.convs, torch.cat([old.mask, new.mask], dim=2))


def _keep(c: PrefixCache, prompt: int, context: int) -> PrefixCache:
    """The first ``prompt`` frames and the last ``context`` of the rest."""
    n = c.frames
    if n <= prompt + context:
        return c
    idx = torch.cat([torch.arange(prompt), torch.arange(n - context, n)])
    return PrefixCache(c.keys[:, :, :, idx], c.values[:, :, :, idx], c.convs, c.mask[:, :, idx])
