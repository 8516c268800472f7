"""Euler solver for S3Gen's conditional flow matching (CFM) decoder.

The ODE ``dx/dt = v(x, t | mu, spks, cond)`` is integrated from noise at t = 0 to mel at t = 1 with
fixed Euler steps over one time grid. The velocity comes from an *estimator*: any callable that takes one
:class:`EstimatorInputs` bundle (the ConditionalDecoder's inputs, named as the tensor contract names them)
and returns the velocity: a torch module, an ONNX Runtime session, a TensorRT engine or a Triton BLS call,
each behind its adapter, so the same loop serves every backend.

Example::

    grid = time_grid(10, "cosine")
    field = ClassifierFreeGuidance(estimator, mu, mask, spks, cond, rate=0.7)
    result = euler_solve(field, z, grid)
    result.x, result.nfe

Shapes: ``x, z, mu, cond: (B, n_feats, T)``; ``mask: (B, 1, T)``; ``spks: (B, n_feats)``; ``t, r: (B,)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Protocol

import numpy as np
import torch

from s3flow_contract.tensors import estimator_inputs, names
from s3flow.model.prefix_cache import PrefixCache

Schedule = Literal["linear", "cosine"]

#: Guidance weight of the regular (non-distilled) checkpoints.
DEFAULT_GUIDANCE_RATE = 0.7
#: Euler steps for regular checkpoints (with guidance) and for distilled meanflow checkpoints.
DEFAULT_STEPS_CFG = 10
DEFAULT_STEPS_MEANFLOW = 2


@dataclass
class EstimatorInputs:
    """One estimator call's inputs, by the names the tensor contract gives them (``s3flow_contract.tensors.
    estimator_inputs``): x, mu, cond (B, n_feats, T), mask (B, 1, T), t (B,), spks (B, n_feats), and r (B,)
    for meanflow estimators only (None otherwise).

    ``past`` and ``keep``: the prefix cache (``s3flow.model.prefix_cache``) that only an estimator whose
    ``carries_prefix`` is true takes (the torch module in process; over BLS, the served cached graph, which takes
    them packed as the contract's ``past``): the rows follow ``past``'s frames, and with ``keep`` (B,) the
    estimator returns (velocity, the first ``keep`` frames' cache)."""
    x: torch.Tensor
    mask: torch.Tensor
    mu: torch.Tensor
    t: torch.Tensor
    spks: torch.Tensor
    cond: torch.Tensor
    r: Optional[torch.Tensor] = None
    past: Optional[PrefixCache] = None
    keep: Optional[torch.Tensor] = None

    @property
    def meanflow(self) -> bool:
        return self.r is not None

    def named(self) -> dict[str, torch.Tensor]:
        """{contract name: tensor} in the graph's order (r only for meanflow): the form every backend takes."""
        return {name: getattr(self, name) for name in names(estimator_inputs(self.meanflow))}


class Estimator(Protocol):
    """``velocity (B, n_feats, T) = estimator(inputs: EstimatorInputs)``."""

    def __call__(self, inputs: EstimatorInputs) -> torch.Tensor: ...


def default_steps(meanflow: bool) -> int:
    return DEFAULT_STEPS_MEANFLOW if meanflow else DEFAULT_STEPS_CFG


def time_grid(n_steps: int, schedule: Schedule, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """The n_steps + 1 time points from 0 to 1.

    ``linear`` is the plain grid (meanflow). ``cosine`` warps it with ``1 - cos(t * pi / 2)``, which puts
    dense steps near t = 0 where the trajectory bends most (the guided path of regular checkpoints).
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    grid = torch.linspace(0.0, 1.0, n_steps + 1, dtype=torch.float64)
    if schedule == "cosine":
        grid = 1.0 - torch.cos(grid * (math.pi / 2))
        grid[-1] = 1.0  # cos(pi / 2) is 6e-17 in floating point: end exactly at t = 1
    elif schedule != "linear":
        raise ValueError(f"schedule must be 'linear' or 'cosine', got {schedule!r}")
    return grid.to(dtype=dtype, device=device)


class CountingEstimator:
    """Wraps an estimator and counts network function evaluations (one per call, whatever the batch)."""

    def __init__(self, estimator: Estimator):
        self.estimator = estimator
        self.nfe = 0

    def __call__(self, inputs: EstimatorInputs) -> torch.Tensor:
        self.nfe += 1
        return self.estimator(inputs)


class VelocityField(Protocol):
    """The solver's view of the model: ``v = field(x, t, r)`` with scalar 0-d tensors t, r."""

    def __call__(self, x: torch.Tensor, t: torch.Tensor, r: torch.Tensor) -> torch.Tensor: ...


class ConditionalField:
    """One estimator call per step on the conditional batch (B rows); meanflow also receives r."""

    def __init__(self, estimator: Estimator, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor,
                 cond: torch.Tensor, meanflow: bool = False):
        self.estimator, self.meanflow = estimator, meanflow
        b = mu.shape[0]
        like = dict(dtype=mu.dtype, device=mu.device)
        self.inputs = EstimatorInputs(x=mu, mask=mask, mu=mu, t=torch.empty(b, **like), spks=spks, cond=cond,
                                      r=torch.empty(b, **like) if meanflow else None)

    def __call__(self, x, t, r):
        self.inputs.x = x
        self.inputs.t.fill_(t)
        if self.inputs.r is not None:
            self.inputs.r.fill_(r)
        return self.estimator(self.inputs)


class ClassifierFreeGuidance:
    """Classifier-free guidance as ONE estimator call on a 2B batch.

    Rows [0, B) are conditional; rows [B, 2B) carry mu = spks = cond = 0, which is what training used
    for "no condition" (the condition was multiplied by zero). x, mask and t are the same in both halves.
    ``v = (1 + w) * v_cond - w * v_uncond``. The 2B input buffers are allocated once here and filled
    by slice assignment each step: no per-step concatenation.
    """

    def __init__(self, estimator: Estimator, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor,
                 cond: torch.Tensor, rate: float = DEFAULT_GUIDANCE_RATE, meanflow: bool = False):
        b = mu.shape[0]
        self.estimator, self.rate, self.b, self.meanflow = estimator, float(rate), b, meanflow
        like = dict(dtype=mu.dtype, device=mu.device)
        rows = torch.empty((2 * b,) + tuple(mu.shape[1:]), **like)
        self.inputs = EstimatorInputs(
            x=rows, mask=torch.empty((2 * b,) + tuple(mask.shape[1:]), **like), mu=torch.zeros_like(rows),
            t=torch.empty(2 * b, **like), spks=torch.zeros((2 * b,) + tuple(spks.shape[1:]), **like),
            cond=torch.zeros_like(rows), r=torch.empty(2 * b, **like) if meanflow else None)
        i = self.inputs
        i.mask[:b] = mask
        i.mask[b:] = mask
        i.mu[:b] = mu
        i.cond[:b] = cond
        i.spks[:b] = spks

    def __call__(self, x, t, r):
        b, i = self.b, self.inputs
        i.x[:b] = x
        i.x[b:] = x
        i.t.fill_(t)
        if i.r is not None:
            i.r.fill_(r)
        v = self.estimator(i)
        return (1.0 + self.rate) * v[:b] - self.rate * v[b:]


@dataclass
class SolveResult:
    """x: (B, n_feats, T) the state at the grid's end; nfe: estimator calls made."""
    x: torch.Tensor
    nfe: int


def euler_solve(field: VelocityField, x_init: torch.Tensor, grid: torch.Tensor,
                on_step: Optional[Callable[[int], None]] = None) -> SolveResult:
    """Fixed-step Euler: ``x <- x + (grid[i+1] - grid[i]) * field(x, grid[i], grid[i+1])``.

    Args:
        field: the velocity field (see ConditionalField, ClassifierFreeGuidance).
        x_init: (B, n_feats, T) the state at grid[0] (noise at t = 0).
        grid: (n + 1,) time points.
        on_step: called with the step index before each step (cancellation checks raise from here).
    """
    x = x_init.clone()
    steps = grid.shape[0] - 1
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        t, r = grid[i], grid[i + 1]
        x = x + (r - t) * field(x, t, r)
    return SolveResult(x=x, nfe=steps)


def make_field(estimator: Estimator, mu, mask, spks, cond, *, meanflow: bool,
               guidance_rate: float) -> VelocityField:
    """The velocity field a checkpoint needs: meanflow is single-batch and unguided (guidance is baked
    into its weights); a regular checkpoint uses one 2B guided call, or a plain call at rate 0."""
    if meanflow or guidance_rate == 0.0:
        return ConditionalField(estimator, mu, mask, spks, cond, meanflow=meanflow)
    return ClassifierFreeGuidance(estimator, mu, mask, spks, cond, rate=guidance_rate)


def solve_cfm(estimator: Estimator, z: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor,
              spks: torch.Tensor, cond: torch.Tensor, *, meanflow: bool = False,
              n_steps: Optional[int] = None, guidance_rate: float = DEFAULT_GUIDANCE_RATE,
              on_step: Optional[Callable[[int], None]] = None) -> SolveResult:
    """Integrate the CFM ODE from noise z to mel, the way S3Gen does.

    Args:
        estimator: the ConditionalDecoder callable.
        z: (B, n_feats, T) initial noise (see ``s3flow.model.chunks.starting_point``).
        mu: (B, n_feats, T) encoder output; mask: (B, 1, T); spks: (B, n_feats); cond: (B, n_feats, T).
        meanflow: distilled checkpoint: linear grid, (t, r) to the estimator, no guidance.
        n_steps: Euler steps (default 2 for meanflow, 10 otherwise).
        guidance_rate: w in ``(1 + w) v_cond - w v_uncond`` (ignored for meanflow).
    """
    field = make_field(estimator, mu, mask, spks, cond, meanflow=meanflow, guidance_rate=guidance_rate)
    return euler_solve(field, z, cfm_grid(n_steps, meanflow, mu), on_step=on_step)


def cfm_grid(n_steps: Optional[int], meanflow: bool, like: torch.Tensor) -> torch.Tensor:
    """S3Gen's time grid: ``n_steps`` (default 2 for meanflow, 10 otherwise) on the linear grid for
    meanflow, the cosine grid for regular checkpoints; dtype and device of ``like``."""
    n = default_steps(meanflow) if n_steps is None else int(n_steps)
    return time_grid(n, "linear" if meanflow else "cosine", dtype=like.dtype, device=like.device)


# ---------------------------------------------------------------------------------------------------
# Initial noise (pinned per chunk by ``s3flow.model.chunks.starting_point``)


class FrameNoise:
    """Seeded noise that is a function of (seed, frame index) only.

    ``frames(a, b)`` returns the same values for a frame whichever chunk asks for it, so a streamed
    utterance and its offline synthesis start the ODE from the same point. Noise is drawn in blocks of
    ``block`` frames, each block from its own ``numpy`` generator keyed by (seed, region, block).
    The prompt region (region 0) and the generated region (region 1) are separate streams.
    """

    def __init__(self, seed: int, n_feats: int, block: int = 50):
        if not 0 <= int(seed) < 2 ** 63:
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")
        self.seed, self.n_feats, self.block = int(seed), int(n_feats), int(block)

    def _region(self, region: int, start: int, stop: int) -> np.ndarray:
        out = np.empty((self.n_feats, max(stop - start, 0)), dtype=np.float32)
        first, last = start // self.block, (stop - 1) // self.block
        for blk in range(first, last + 1) if stop > start else ():
            rng = np.random.default_rng([self.seed, region, blk])
            values = rng.standard_normal((self.block, self.n_feats), dtype=np.float32).T
            lo, hi = max(start, blk * self.block), min(stop, (blk + 1) * self.block)
            out[:, lo - start:hi - start] = values[:, lo - blk * self.block:hi - blk * self.block]
        return out

    def prompt(self, frames: int) -> np.ndarray:
        """(n_feats, frames) noise for the prompt region."""
        return self._region(0, 0, frames)

    def frames(self, start: int, stop: int) -> np.ndarray:
        """(n_feats, stop - start) noise for generated frames [start, stop)."""
        return self._region(1, start, stop)

    def full(self, prompt_frames: int, generated_frames: int) -> np.ndarray:
        """(n_feats, prompt_frames + generated_frames): the whole initial noise of one utterance."""
        return np.concatenate([self.prompt(prompt_frames), self.frames(0, generated_frames)], axis=1)
