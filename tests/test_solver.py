"""The Euler CFM solver against closed forms and against a second code path."""
import math

import numpy as np
import pytest
import torch

from s3flow_contract import tensors as contract
from s3flow.model.solver import (ClassifierFreeGuidance, ConditionalField, CountingEstimator, EstimatorInputs,
                                 FrameNoise, euler_solve, solve_cfm, time_grid)


def np_grid(n, schedule):
    g = np.linspace(0.0, 1.0, n + 1)
    return 1.0 - np.cos(g * np.pi / 2) if schedule == "cosine" else g


class LinearField:
    """v(x, t) = a * x + b * t + c: Euler's answer is a closed-form recursion we evaluate in float64."""

    def __init__(self, a, b, c):
        self.a, self.b, self.c = a, b, c

    def __call__(self, x, t, r):
        return self.a * x + self.b * t + self.c


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("n", [1, 2, 10, 33])
def test_euler_matches_closed_form_on_linear_field(schedule, n):
    a, b, c = -0.7, 1.3, 0.25
    grid = time_grid(n, schedule, dtype=torch.float64)
    x0 = torch.linspace(-2, 2, 12, dtype=torch.float64).reshape(1, 3, 4)
    got = euler_solve(LinearField(a, b, c), x0, grid)
    g = np_grid(n, schedule)
    # Euler on x' = a x + b t + c: x_n = prod(1 + a h_i) x0 + sum_i (b t_i + c) h_i prod_{j>i}(1 + a h_j)
    h = np.diff(g)
    growth = np.prod(1 + a * h)
    forcing = sum((b * g[i] + c) * h[i] * np.prod(1 + a * h[i + 1:]) for i in range(n))
    want = growth * x0.numpy() + forcing
    assert got.nfe == n
    np.testing.assert_allclose(got.x.numpy(), want, rtol=1e-12, atol=1e-12)


def test_constant_field_is_exact_and_euler_converges_to_exponential():
    x0 = torch.ones(1, 1, 1, dtype=torch.float64)
    assert float(euler_solve(LinearField(0, 0, 2.5), x0, time_grid(7, "cosine", torch.float64)).x) == pytest.approx(3.5)
    errors = [abs(float(euler_solve(LinearField(1.0, 0, 0), x0, time_grid(n, "linear", torch.float64)).x) - math.e)
              for n in (10, 100, 1000)]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 2e-3  # first-order: error ~ e/(2n)


def test_cosine_grid_values_for_ten_steps():
    g = time_grid(10, "cosine", dtype=torch.float64).numpy()
    np.testing.assert_allclose(g, [1 - math.cos(i / 10 * math.pi / 2) for i in range(11)], atol=1e-15)
    assert g[1] == pytest.approx(0.0123116594, abs=1e-9)
    assert g[5] == pytest.approx(0.2928932188, abs=1e-9)
    assert g[9] == pytest.approx(0.8435655350, abs=1e-9)
    assert g[0] == 0 and g[-1] == 1
    assert np.all(np.diff(np.diff(g)) > 0), "steps grow: dense near t = 0"
    np.testing.assert_allclose(time_grid(4, "linear").numpy(), [0, 0.25, 0.5, 0.75, 1.0])
    with pytest.raises(ValueError, match="n_steps"):
        time_grid(0, "linear")


class ToyEstimator:
    """A nonlinear function of every input (one EstimatorInputs bundle), recording each call's tensors."""

    def __init__(self, n_feats=5, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.w = [torch.randn(n_feats, n_feats, generator=g) * 0.5 for _ in range(3)]
        self.calls = []

    def __call__(self, inputs):
        assert isinstance(inputs, EstimatorInputs), type(inputs)
        x, mask, mu, t, spks, cond, r = (inputs.x, inputs.mask, inputs.mu, inputs.t, inputs.spks, inputs.cond,
                                         inputs.r)
        self.calls.append(dict(x=x, mask=mask, mu=mu, t=t.clone(), spks=spks, cond=cond,
                               r=None if r is None else r.clone(), ptr=x.data_ptr()))
        h = (torch.einsum("ij,bjt->bit", self.w[0], x) + torch.einsum("ij,bjt->bit", self.w[1], mu)
             + torch.einsum("ij,bjt->bit", self.w[2], cond) + spks[:, :, None] + t[:, None, None])
        if r is not None:
            h = h + 2 * r[:, None, None]
        return torch.tanh(h) * mask


def toy_inputs(b=3, c=5, t=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    mu, cond, z = (torch.randn(b, c, t, generator=g) for _ in range(3))
    spks = torch.randn(b, c, generator=g)
    mask = torch.ones(b, 1, t)
    mask[1, :, 5:] = 0
    return z, mu, mask, spks, cond


def test_guidance_is_one_2b_call_equal_to_two_separate_calls():
    z, mu, mask, spks, cond = toy_inputs()
    b, w = z.shape[0], 0.7
    est = ToyEstimator()
    cfg = ClassifierFreeGuidance(est, mu, mask, spks, cond, rate=w)
    t = torch.tensor(0.3)
    got = cfg(z, t, torch.tensor(0.5))
    assert len(est.calls) == 1
    call = est.calls[0]
    assert call["x"].shape[0] == 2 * b
    # the second half is "no condition": zeros for mu, spks and cond; same x, mask and t
    assert torch.count_nonzero(call["mu"][b:]) == 0 and torch.count_nonzero(call["spks"][b:]) == 0
    assert torch.count_nonzero(call["cond"][b:]) == 0
    assert torch.equal(call["x"][:b], call["x"][b:]) and torch.equal(call["mask"][:b], call["mask"][b:])
    sep = ToyEstimator()
    tt = torch.full((b,), 0.3)
    v_c = sep(EstimatorInputs(x=z, mask=mask, mu=mu, t=tt, spks=spks, cond=cond))
    v_u = sep(EstimatorInputs(x=z, mask=mask, mu=torch.zeros_like(mu), t=tt, spks=torch.zeros_like(spks),
                              cond=torch.zeros_like(cond)))
    torch.testing.assert_close(got, (1 + w) * v_c - w * v_u, rtol=1e-6, atol=1e-6)


def test_guided_solve_reuses_buffers_and_counts_nfe():
    z, mu, mask, spks, cond = toy_inputs()
    est = ToyEstimator()
    counted = CountingEstimator(est)
    res = solve_cfm(counted, z, mu, mask, spks, cond, n_steps=10, guidance_rate=0.7)
    assert res.nfe == counted.nfe == 10
    assert len({c["ptr"] for c in est.calls}) == 1, "2B input buffer must be allocated once per solve"
    ts = [float(c["t"][0]) for c in est.calls]
    np.testing.assert_allclose(ts, np_grid(10, "cosine")[:-1], atol=1e-7)
    assert all(c["r"] is None for c in est.calls)


def test_meanflow_passes_r_single_batch_no_guidance():
    z, mu, mask, spks, cond = toy_inputs()
    est = ToyEstimator()
    res = solve_cfm(est, z, mu, mask, spks, cond, meanflow=True)
    assert res.nfe == 2 and len(est.calls) == 2
    for i, c in enumerate(est.calls):
        assert c["x"].shape[0] == z.shape[0]
        assert float(c["t"][0]) == pytest.approx(i / 2) and float(c["r"][0]) == pytest.approx((i + 1) / 2)
    # equals a hand-written two-step Euler over the linear grid with the conditional field only
    x = z.clone()
    ref = ToyEstimator()
    b = z.shape[0]
    for t0, t1 in [(0.0, 0.5), (0.5, 1.0)]:
        x = x + (t1 - t0) * ref(EstimatorInputs(x=x, mask=mask, mu=mu, t=torch.full((b,), t0), spks=spks, cond=cond,
                                                r=torch.full((b,), t1)))
    torch.testing.assert_close(res.x, x)


def test_zero_guidance_runs_the_conditional_batch_only():
    z, mu, mask, spks, cond = toy_inputs()
    est = ToyEstimator()
    solve_cfm(est, z, mu, mask, spks, cond, n_steps=3, guidance_rate=0.0)
    assert [c["x"].shape[0] for c in est.calls] == [z.shape[0]] * 3
    field = ConditionalField(est, mu, mask, spks, cond)
    assert field(z, torch.tensor(0.1), torch.tensor(0.2)).shape == z.shape


@pytest.mark.parametrize("meanflow", [False, True])
def test_estimator_inputs_are_named_as_the_contract_names_them(meanflow):
    z, mu, mask, spks, cond = toy_inputs()
    t = torch.full((z.shape[0],), 0.25)
    inputs = EstimatorInputs(x=z, mask=mask, mu=mu, t=t, spks=spks, cond=cond,
                             r=torch.full_like(t, 0.5) if meanflow else None)
    assert inputs.meanflow is meanflow
    named = inputs.named()
    want = contract.names(contract.estimator_inputs(meanflow))
    assert tuple(named) == want and ("r" in want) is meanflow   # exactly these names, in graph order
    assert all(named[name] is getattr(inputs, name) for name in want)   # the bundle's own tensors, no copy


@pytest.mark.parametrize("meanflow", [False, True])
def test_guided_field_makes_one_call_with_one_bundle_of_2b_rows(meanflow):
    z, mu, mask, spks, cond = toy_inputs()
    b = z.shape[0]
    seen = []

    def estimate(*args, **kwargs):   # any call shape: the test checks what the field passes
        named = {k: v.clone() for k, v in args[0].named().items()} if args else {}
        seen.append((args, kwargs, named))
        return torch.zeros((2 * b,) + tuple(z.shape[1:]))

    field = ClassifierFreeGuidance(estimate, mu, mask, spks, cond, rate=0.7, meanflow=meanflow)
    field(z, torch.tensor(0.3), torch.tensor(0.6))
    assert len(seen) == 1
    args, kwargs, got = seen[0]
    assert kwargs == {} and len(args) == 1 and isinstance(args[0], EstimatorInputs)
    assert args[0] is field.inputs and args[0].meanflow is meanflow
    assert tuple(got) == contract.names(contract.estimator_inputs(meanflow))
    assert all(v.shape[0] == 2 * b for v in got.values())
    # rows [0, B): the conditional batch as given
    for name, want in (("x", z), ("mask", mask), ("mu", mu), ("spks", spks), ("cond", cond)):
        assert torch.equal(got[name][:b], want), name
    assert torch.equal(got["t"], torch.full((2 * b,), 0.3))
    # rows [B, 2B): "no condition" (mu = spks = cond = 0) with the same x, mask and t
    for name in ("mu", "spks", "cond"):
        assert torch.count_nonzero(got[name][b:]) == 0, name
    for name in ("x", "mask", "t") + (("r",) if meanflow else ()):
        assert torch.equal(got[name][b:], got[name][:b]), name
    if meanflow:
        assert torch.equal(got["r"], torch.full((2 * b,), 0.6))


def test_frame_noise_is_a_function_of_seed_and_frame():
    n = FrameNoise(seed=11, n_feats=8, block=5)
    whole = n.frames(0, 37)
    parts = np.concatenate([n.frames(0, 3), n.frames(3, 10), n.frames(10, 11), n.frames(11, 37)], axis=1)
    np.testing.assert_array_equal(whole, parts)
    assert whole.shape == (8, 37) and abs(whole.std() - 1) < 0.2
    assert not np.allclose(n.frames(0, 10), FrameNoise(seed=12, n_feats=8, block=5).frames(0, 10))
    assert not np.allclose(n.prompt(10), n.frames(0, 10))
    np.testing.assert_array_equal(n.full(4, 6), np.concatenate([n.prompt(4), n.frames(0, 6)], axis=1))
    assert n.frames(5, 5).shape == (8, 0)
    with pytest.raises(ValueError, match="seed"):
        FrameNoise(seed=-1, n_feats=8)
