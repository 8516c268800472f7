"""One Euler step over the rows of many chunks (``s3flow.engine.stepping``): the unit of the step-level scheduler.

Against a second code path: ``s3flow.model.solver.solve_cfm`` (one utterance, its own 2B guided batch) on the small
estimator with every parameter perturbed (biases, norms and the meanflow mixer included), torch, float32.
"""
from __future__ import annotations

import pytest
import torch

from helpers import small_flow
from s3flow.engine.stepping import RowSolve, StepBatch
from s3flow.model.flow import TorchEstimator
from s3flow.model.solver import cfm_grid, solve_cfm

pytestmark = pytest.mark.usefixtures("one_torch_thread")
N_FEATS = 80


def inputs(frames: int, seed: int):
    """(mu, mask, spks, cond, z) of one row of ``frames`` frames, random but seeded."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(N_FEATS, frames, generator=g)
    cond = torch.zeros(N_FEATS, frames)
    cond[:, :frames // 3] = torch.randn(N_FEATS, frames // 3, generator=g)   # a prompt region
    return mu, torch.ones(1, frames), torch.randn(N_FEATS, generator=g), cond, torch.randn(N_FEATS, frames, generator=g)


def alone(estimator, frames: int, seed: int, steps: int, rate: float, meanflow: bool) -> torch.Tensor:
    mu, mask, spks, cond, z = inputs(frames, seed)
    return solve_cfm(estimator, z[None], mu[None], mask[None], spks[None], cond[None], meanflow=meanflow,
                     n_steps=steps, guidance_rate=rate).x[0]


def row(frames: int, seed: int, steps: int, rate: float, meanflow: bool) -> RowSolve:
    mu, mask, spks, cond, z = inputs(frames, seed)
    return RowSolve(mu=mu, mask=mask, spks=spks, cond=cond, x=z.clone(), grid=cfm_grid(steps, meanflow, mu), rate=rate)


@pytest.mark.parametrize("meanflow,rate", [(False, 0.7), (False, 0.0), (True, 0.0)], ids=["guided", "unguided", "meanflow"])
def test_a_solve_stepped_alone_is_the_solver_bit_for_bit(meanflow, rate):
    est = TorchEstimator(small_flow(meanflow, seed=4).estimator)
    steps = 2 if meanflow else 6
    s = row(37, 1, steps, rate, meanflow)
    batch = StepBatch([s], meanflow)
    while not s.done:
        batch.step(est)
    assert torch.equal(s.x, alone(est, 37, 1, steps, rate, meanflow))


def test_solves_at_their_own_steps_lengths_and_rates_in_one_call_equal_each_alone():
    """The scheduler's case: three chunks of different lengths, step counts and guidance rates, the second
    joining two steps after the first began, the third joining later and unguided; every call carries the rows
    of all that have steps left (each at its own t). Each ends within the batched tolerance of its solo solve
    (2e-4, as test_batched_chunks_equal_one_by_one; padding changes the arithmetic of the wider batch)."""
    est = TorchEstimator(small_flow(False, seed=5).estimator)
    plans = [(41, 11, 6, 0.7, 0), (23, 12, 4, 0.5, 2), (30, 13, 5, 0.0, 3)]   # frames, seed, steps, rate, joins at
    solves = [row(f, seed, steps, rate, False) for f, seed, steps, rate, _ in plans]
    widest, call = 0, 0
    while not all(s.done for s in solves):
        live = [s for s, p in zip(solves, plans) if p[4] <= call and not s.done]
        batch = StepBatch(live, meanflow=False)
        widest = max(widest, batch.rows)
        batch.step(est)
        call += 1
    assert widest == 2 + 2 + 1, "the three were never in one call"
    for s, (f, seed, steps, rate, _) in zip(solves, plans):
        err = float((s.x - alone(est, f, seed, steps, rate, False)).abs().max())
        assert err < 2e-4, (f, steps, rate, err)


def test_a_step_batch_refuses_what_it_cannot_step():
    est = TorchEstimator(small_flow(False, seed=6).estimator)
    with pytest.raises(ValueError, match="needs at least one solve"):
        StepBatch([], meanflow=False)
    with pytest.raises(ValueError, match="meanflow estimators take no guidance"):
        StepBatch([row(10, 1, 2, 0.7, True)], meanflow=True)
    s = row(10, 1, 1, 0.7, False)
    batch = StepBatch([s], meanflow=False)
    batch.step(est)
    with pytest.raises(ValueError, match="solve 0 has made all its 1 steps"):
        batch.step(est)
