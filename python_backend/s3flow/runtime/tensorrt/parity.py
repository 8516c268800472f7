"""Parity of an engine against the fp32 reference: relative L2 error over valid frames, and NaN/inf.

An engine passes when it is finite and under :data:`PARITY_BOUNDS` of its precision against the reference
(the torch module, e.g. ``s3flow.runtime.torch_runner.TorchRunner``, or ONNX Runtime on the fp32 ONNX:
:func:`onnxruntime_engine`). Engines and references are alike here: callables taking torch tensors by input
name and returning a dict of output tensors by name (``TrtEngine``, ``TorchRunner``, :func:`onnxruntime_engine`).
The checks draw seeded random padded inputs whose names, dtypes and dims come from the contract.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from s3flow_contract import tensors as contract
from s3flow.runtime.tensorrt.profiles import Profile

#: Relative L2 error bound against the fp32 reference, per engine precision (estimator and encoder).
PARITY_BOUNDS = {"fp32": 1e-3, "fp16": 2e-2}

MASK = contract.by_name(contract.estimator_inputs(meanflow=False))["mask"].name
[VELOCITY] = contract.names(contract.ESTIMATOR_OUTPUTS)
ENC_MU, ENC_MASK, ENC_SPKS = contract.names(contract.ENCODER_OUTPUTS)

#: engine or reference: torch tensors by input name -> torch tensors by output name
Runner = Callable[..., dict]


@dataclass
class Parity:
    """One comparison against the fp32 reference. rel_error: ||out - ref|| / ||ref|| over valid frames."""
    what: str
    rel_error: float
    max_abs: float
    finite: bool
    bound: float

    @property
    def ok(self) -> bool:
        return self.finite and self.rel_error <= self.bound

    def describe(self) -> str:
        state = "ok" if self.ok else ("FAIL: NaN/inf" if not self.finite else "FAIL: above bound")
        return (f"{self.what}: rel err {self.rel_error:.2e} (bound {self.bound:.0e}), "
                f"max abs {self.max_abs:.2e} [{state}]")


def compare(out: torch.Tensor, ref: torch.Tensor, bound: float, what: str = "",
            mask: Optional[torch.Tensor] = None) -> Parity:
    """Relative L2 error of ``out`` against ``ref`` (same shape), over ``mask`` (broadcast) if given.

    NaN or inf anywhere in ``out`` fails whatever the error.
    """
    out, ref = out.detach().float().cpu(), ref.detach().float().cpu()
    if out.shape != ref.shape:
        raise ValueError(f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    finite = bool(torch.isfinite(out).all())
    if mask is not None:
        m = mask.detach().float().cpu().expand_as(ref) > 0
        out, ref = out[m], ref[m]
    diff = torch.nan_to_num(out - ref, nan=float("inf"))
    denom = float(ref.norm()) or 1.0
    rel = float(diff.norm()) / denom if finite else float("inf")
    return Parity(what, rel, float(diff.abs().max()) if diff.numel() else 0.0, finite, bound)


def rel_l2(out: np.ndarray, ref: np.ndarray) -> tuple[float, bool]:
    """(||out - ref|| / ||ref||, all finite) of two numpy arrays of one shape (computed in float64)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {out.shape} vs {ref.shape}")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)), bool(np.isfinite(out).all())


def random_inputs(profile: Profile, batch: int, length: int, lengths: torch.Tensor, generator: torch.Generator,
                  vocab: int = contract.VOCAB_SIZE) -> dict[str, torch.Tensor]:
    """Seeded inputs of the profile's model at (batch, length), in graph order: the estimator's mask from
    ``lengths`` (valid frames per row), 1-d floats (times) ~ U(0, 1), other floats ~ N(0, 1); the encoder's
    tokens uniform ids, its lengths ``lengths``."""
    out = {}
    for t in profile.tensors():
        dims = profile.input_dims()[t.name]
        shape = tuple(batch if d == "B" else length if d == "L" else d for d in dims)
        if t.name == MASK and profile.model == "estimator":
            out[t.name] = (torch.arange(length)[None] < lengths[:, None]).float()[:, None]
        elif t.dtype == "int64":
            out[t.name] = lengths.long() if len(shape) == 1 else torch.randint(0, vocab, shape, generator=generator)
        elif len(shape) == 1:
            out[t.name] = torch.rand(shape, generator=generator)
        else:
            out[t.name] = torch.randn(shape, generator=generator)
    return out


def estimator_cases(profile: Profile) -> list[tuple[int, int]]:
    """(batch, frames) shapes a parity check runs: the opt point and an odd padded one, inside the profile."""
    b_lo, b_opt, b_hi = profile.batch
    t_lo, t_opt, t_hi = profile.length
    cases = [(b_opt, t_opt), (min(max(b_opt + 1, b_lo), b_hi), min(max(t_opt * 2 + 17, t_lo), t_hi))]
    return list(dict.fromkeys(cases))


def encoder_cases(profile: Profile) -> list[tuple[int, int]]:
    """(batch, tokens) shapes of the encoder's check: the opt point and a padded batch of at least two."""
    b_lo, b_opt, b_hi = profile.batch
    n_lo, n_opt, n_hi = profile.length
    return list(dict.fromkeys([(b_opt, n_opt), (min(max(2, b_lo), b_hi), min(max(n_opt + 37, n_lo), n_hi))]))


def _case(engine: Runner, reference: Runner, profile: Profile, b: int, n: int, lengths: list, seed: int):
    """One shape's inputs (seeded by the shape) and both runners' outputs on them."""
    g = torch.Generator().manual_seed(seed + b * 10007 + n)
    inputs = random_inputs(profile, b, n, torch.tensor(lengths, dtype=torch.int64), g)
    return inputs, reference(**inputs), engine(**inputs)


def check_estimator_engine(engine: Runner, reference: Runner, profile: Profile, precision: str,
                           seed: int = 0) -> list[Parity]:
    """Engine vs the fp32 reference on random padded inputs: the velocity over valid frames."""
    out = []
    for b, t in estimator_cases(profile):
        lengths = [max(1, t - (i * t) // (2 * b)) for i in range(b)]
        inputs, ref, got = _case(engine, reference, profile, b, t, lengths, seed)
        out.append(compare(got[VELOCITY], ref[VELOCITY], PARITY_BOUNDS[precision],
                           f"estimator {precision} B={b} T={t}", mask=inputs[MASK]))
    return out


def check_encoder_engine(engine: Runner, reference: Runner, profile: Profile, precision: str,
                         seed: int = 0) -> list[Parity]:
    """Encoder engine vs the fp32 reference: mu over the reference's valid frames, and spks."""
    out = []
    for b, n in encoder_cases(profile):
        lengths = [max(profile.length[0], n - (i * n) // (2 * b)) for i in range(b)]
        _, ref, got = _case(engine, reference, profile, b, n, lengths, seed)
        bound = PARITY_BOUNDS[precision]
        out.append(compare(got[ENC_MU], ref[ENC_MU], bound, f"encoder mu {precision} B={b} N={n}",
                           mask=ref[ENC_MASK]))
        out.append(compare(got[ENC_SPKS], ref[ENC_SPKS], bound, f"encoder spks {precision} B={b}"))
    return out


def check_engine(engine: Runner, reference: Runner, profile: Profile, precision: str, seed: int = 0) -> list[Parity]:
    """The check of ``profile.model``'s engine (estimator or flow_encoder)."""
    check = check_estimator_engine if profile.model == "estimator" else check_encoder_engine
    return check(engine, reference, profile, precision, seed)


def onnxruntime_engine(onnx_path: str | os.PathLike) -> Runner:
    """An ONNX file in ONNX Runtime on the CPU, called like an engine: the fp32 reference where the torch
    checkpoint is not at hand (or, on an fp16 copy, a stand-in for an fp16 engine on CPU hosts)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    inputs = [i.name for i in sess.get_inputs()]
    outputs = [o.name for o in sess.get_outputs()]

    def run(**feeds: torch.Tensor) -> dict[str, torch.Tensor]:
        feed = {k: v.detach().cpu().numpy() for k, v in feeds.items() if k in inputs}
        return {name: torch.from_numpy(v) for name, v in zip(outputs, sess.run(outputs, feed))}
    return run
