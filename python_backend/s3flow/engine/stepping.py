"""One Euler step over the rows of many chunks in one estimator call: the unit a step-level scheduler batches.

Each chunk's ODE in progress is a :class:`RowSolve`: its own conditioning (mu, mask, spks, cond over its own
frames), its state ``x``, its time grid and how many steps it has made. A :class:`StepBatch` is one estimator
call's inputs for a fixed list of solves, whatever their lengths, step indexes, guidance rates and grids:

* rows ``[0, B)`` are every solve's conditional row, zero-padded to the longest (the mask is 0 beyond a row's
  frames); rows ``[B, B + G)`` are the unconditional rows of the G guided solves (mu = spks = cond = 0, the
  same x, mask and t), as ``s3flow.model.solver.ClassifierFreeGuidance`` lays out one utterance's 2B batch;
* each row has its own ``t`` (and ``r`` for meanflow): ``grid[step]`` and ``grid[step + 1]`` of its solve;
* after the call, each solve takes ``v = (1 + w) v_cond - w v_uncond`` (or ``v_cond`` unguided) over its own
  frames and steps ``x <- x + (r - t) v``.

The buffers are allocated once per batch and refilled by slice assignment at every step (no per-step
concatenation: the design card's rule for the 2B buffers); a batch of the same solves step after step (the
engine's FIFO path) is built once per solve, a scheduler that changes the rows builds a new one when it does.
Padded frames stay 0 (the estimator's output is masked there), so a row's result does not depend on its
neighbours but through the backend's arithmetic on a wider batch.

A solve may read frames it does not solve (``past``: one ``PrefixCache`` per step and row, ``s3flow.model.
prefix_cache``: what its stream kept, ``s3flow.engine.reuse``) and keep its first ``keep`` frames' cache at every
step (``recorded``: what the stream keeps for its later chunks); a batch whose solves do either passes the
estimator the caches, padded (rows without one read none).

Example::

    solves = [RowSolve.start(mu_i, mask_i, spks_i, cond_i, z_i, cfm_grid(10, False, mu_i), rate=0.7), ...]
    batch = StepBatch(solves, meanflow=False)
    while not all(s.done for s in solves):
        batch.step(estimator)                 # every solve one step on
    x_i = solves[i].x                         # (n_feats, T_i)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from s3flow.model.prefix_cache import PrefixCache
from s3flow.model.solver import Estimator, EstimatorInputs

#: one Euler step's prefix caches of one solve: its conditional row's, its unconditional row's (None unguided)
StepCaches = tuple[PrefixCache, Optional[PrefixCache]]


@dataclass
class RowSolve:
    """One chunk's ODE from noise to mel, in progress.

    Shapes: ``mu, cond, x: (n_feats, T)``; ``mask: (1, T)``; ``spks: (n_feats,)``; ``grid: (n + 1,)``.
    """
    mu: torch.Tensor
    mask: torch.Tensor
    spks: torch.Tensor
    cond: torch.Tensor
    x: torch.Tensor
    grid: torch.Tensor
    rate: float = 0.0          # guidance weight w (0: unguided, one row)
    step: int = 0              # steps made
    #: per step, the cache of the frames before ``x`` that the rows read (none: None)
    past: Optional[list[StepCaches]] = None
    keep: int = 0              # record the first ``keep`` frames' cache at every step into ``recorded``
    recorded: list[StepCaches] = field(default_factory=list)

    @property
    def frames(self) -> int:
        return int(self.x.shape[1])

    @property
    def steps(self) -> int:
        return int(self.grid.shape[0]) - 1

    @property
    def done(self) -> bool:
        return self.step >= self.steps

    @property
    def guided(self) -> bool:
        return self.rate != 0.0

    @property
    def rows(self) -> int:
        """Estimator rows of one of its steps (2 with guidance)."""
        return 2 if self.guided else 1

    @property
    def past_frames(self) -> int:
        """Frames of the prefix cache its rows read (0: none)."""
        return self.past[0][0].frames if self.past else 0


class StepBatch:
    """One estimator call's buffers for ``solves`` (the module docstring), refilled at every :meth:`step`."""

    def __init__(self, solves: Sequence[RowSolve], meanflow: bool):
        if not solves:
            raise ValueError("a step batch needs at least one solve")
        if meanflow and any(s.guided for s in solves):
            raise ValueError("meanflow estimators take no guidance (it is baked into their weights)")
        self.solves, self.meanflow = list(solves), meanflow
        first = self.solves[0].mu
        n_feats, frames = first.shape[0], max(s.frames for s in self.solves)
        self.guided = [i for i, s in enumerate(self.solves) if s.guided]
        b, rows = len(self.solves), len(self.solves) + len(self.guided)
        like = dict(dtype=first.dtype, device=first.device)
        self.inputs = EstimatorInputs(
            x=torch.zeros(rows, n_feats, frames, **like), mask=torch.zeros(rows, 1, frames, **like),
            mu=torch.zeros(rows, n_feats, frames, **like), t=torch.empty(rows, **like),
            spks=torch.zeros(rows, n_feats, **like), cond=torch.zeros(rows, n_feats, frames, **like),
            r=torch.empty(rows, **like) if meanflow else None)
        i = self.inputs
        for k, s in enumerate(self.solves):
            f = s.frames
            i.mask[k, :, :f] = s.mask
            i.mu[k, :, :f] = s.mu
            i.cond[k, :, :f] = s.cond
            i.spks[k] = s.spks
        for j, k in enumerate(self.guided):   # the unconditional rows: mask only (mu, spks, cond stay 0)
            i.mask[b + j, :, :self.solves[k].frames] = self.solves[k].mask
        self._uncond = {k: b + j for j, k in enumerate(self.guided)}
        self.keep = None
        if any(s.keep for s in self.solves):
            self.keep = torch.zeros(rows, dtype=torch.int64)
            for k, s in enumerate(self.solves):
                self.keep[k] = s.keep
                if k in self._uncond:
                    self.keep[self._uncond[k]] = s.keep

    @property
    def rows(self) -> int:
        return int(self.inputs.x.shape[0])

    @property
    def frames(self) -> int:
        return int(self.inputs.x.shape[2])

    @property
    def past_frames(self) -> int:
        """Frames of the prefix cache each row reads, padded to the longest (0: no solve reads one)."""
        return max(s.past_frames for s in self.solves)

    def step(self, estimator: Estimator) -> None:
        """Every solve of the batch one Euler step on (each must have a step left)."""
        i = self.inputs
        for k, s in enumerate(self.solves):
            if s.done:
                raise ValueError(f"solve {k} has made all its {s.steps} steps")
            rows = (k, self._uncond[k]) if s.guided else (k,)
            for row in rows:
                i.x[row, :, :s.frames] = s.x
                i.t[row] = s.grid[s.step]
                if i.r is not None:
                    i.r[row] = s.grid[s.step + 1]
        i.past, i.keep = self._past(), self.keep
        v = estimator(i)
        if self.keep is not None:
            v, recorded = v
            for k, s in enumerate(self.solves):
                if s.keep:
                    s.recorded.append((recorded.row(k, s.keep).copy(),
                                       recorded.row(self._uncond[k], s.keep).copy() if s.guided else None))
        for k, s in enumerate(self.solves):
            t, r = s.grid[s.step], s.grid[s.step + 1]
            vk = v[k, :, :s.frames]
            if s.guided:
                vk = (1.0 + s.rate) * vk - s.rate * v[self._uncond[k], :, :s.frames]
            s.x = s.x + (r - t) * vk
            s.step += 1

    def _past(self) -> Optional[PrefixCache]:
        """This step's prefix caches of every row, padded to one (None when no solve reads one)."""
        rows: list[Optional[PrefixCache]] = [None] * self.rows
        for k, s in enumerate(self.solves):
            if s.past is not None:
                rows[k], uncond = s.past[s.step]
                if s.guided:
                    rows[self._uncond[k]] = uncond
        return PrefixCache.stack(rows) if any(r is not None for r in rows) else None
