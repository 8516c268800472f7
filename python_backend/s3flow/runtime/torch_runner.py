"""The estimator or encoder in torch on a device: the gpu target's fallback where no engine is built.

``s3flow.serving.triton_models.torch_model`` serves the ``estimator`` (or the ``flow_encoder``) of the gpu
target with it (``--gpu-backend torch``), with the contract's tensor names and shapes. The weights are
``<version>/model.pt`` (written by :func:`save_module`: the module's kind, config and state dict; loaded with
``weights_only=True``).

``dtype``: ``fp32``, ``bf16`` or ``fp16`` (the generator's default for the estimator:
``DEFAULT_ESTIMATOR_DTYPE``; the encoder stays fp32). Weights stay fp32; bf16/fp16 run under
``torch.autocast``, so matrix products and convolutions use the reduced precision while LayerNorm, softmax,
the sinusoidal time embedding (``t * 1000`` through ``sin``/``cos``) and the ``-1e10`` attention-mask
arithmetic stay fp32 (a plain ``.half()`` of the module turns that bias into ``-inf``).

The device comes from the Triton instance group (``KIND_GPU`` -> ``cuda:<device id>``; ``KIND_CPU`` -> ``cpu``,
which the CPU tests use).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from s3flow_contract import tensors as contract
from s3flow.runtime.devices import instance_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = contract.STATELESS_MODELS
WEIGHTS_FILE = "model.pt"
#: The estimator's compute dtype where a builder is not told one (build_repository, build_engines, the image).
DEFAULT_ESTIMATOR_DTYPE = "bf16"


@dataclass
class TorchModelSettings:
    """The model's config parameters and instance placement."""
    dtype: str = "fp32"
    device: str = "cpu"

    @classmethod
    def from_args(cls, params: dict, instance_kind: str = "CPU", device_id: int | str = 0) -> "TorchModelSettings":
        """From Triton's ``parameters`` (string values) and ``model_instance_kind`` / ``_device_id``."""
        dtype = (params.get("dtype") or "fp32").lower()
        if dtype not in DTYPES:
            raise ValueError(f"parameter dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        device = instance_device(instance_kind, device_id)
        return cls(dtype=dtype, device=device)


def save_module(path: str | os.PathLike, kind: str, module: nn.Module) -> Path:
    """Write a module as ``{kind, config (json), state_dict}`` for :func:`load_module`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in module.state_dict().items()}
    torch.save({"kind": kind, "config": json.dumps(dataclasses.asdict(module.config)), "state_dict": state},
               str(path))
    return path


def load_module(path: str | os.PathLike) -> tuple[str, nn.Module]:
    """(kind, module in eval mode, fp32 on the CPU) from a :func:`save_module` file."""
    obj = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or obj.get("kind") not in KINDS or "state_dict" not in obj:
        raise ValueError(f"{path}: not a module file written by save_module")
    config = json.loads(obj["config"])
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    if obj["kind"] == "estimator":
        from s3flow.model.estimator import ConditionalDecoder, EstimatorConfig
        module = ConditionalDecoder(EstimatorConfig(**config))
    else:
        from s3flow.model.encoder import EncoderConfig, FlowEncoder
        module = FlowEncoder(EncoderConfig(**config))
    module.load_state_dict(obj["state_dict"], strict=True)
    return obj["kind"], module.eval()


class TorchRunner:
    """Runs an estimator or encoder on a device: fp32 tensors in, fp32 tensors out, by name.

    ``dtype`` bf16/fp16 runs the module under autocast (weights fp32; see the module docstring).
    """

    def __init__(self, module: nn.Module, kind: str, device: str | torch.device = "cpu", dtype: str = "fp32",
                 cached: bool = False):
        """``cached``: the estimator as its cached graph (``s3flow.runtime.onnx_export.CachedGraph``: the prefix
        cache's tensors in and out)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.kind, self.dtype, self.device = kind, dtype, torch.device(device)
        self.meanflow = bool(getattr(getattr(module, "config", None), "meanflow", False))
        self.cached = bool(cached) and kind == "estimator"
        if self.cached:
            from s3flow.runtime.onnx_export import CachedGraph
            module = CachedGraph(module)
        self.module = module.to(self.device).float().eval()

    @property
    def input_names(self) -> tuple:
        return contract.names(contract.stateless_tensors(self.kind, self.meanflow, self.cached)[0])

    @property
    def output_names(self) -> tuple:
        return contract.names(contract.stateless_tensors(self.kind, cached=self.cached)[1])

    def _autocast(self):
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=DTYPES[self.dtype])

    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        missing = [n for n in self.input_names if n not in inputs or inputs[n] is None]
        if missing:
            raise ValueError(f"{self.kind}: missing inputs {missing}")
        args = []
        for name in self.input_names:
            t = inputs[name].to(self.device, non_blocking=True)
            args.append(t.float() if t.is_floating_point() else t.long())
        with torch.inference_mode(), self._autocast():
            out = self.module(*args)
        out = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        return {name: o.float() for name, o in zip(self.output_names, out)}

    def estimator(self, inputs) -> torch.Tensor:
        """As a solver estimator (``EstimatorInputs`` in; in-process use: tests, gpu_check)."""
        return self(**inputs.named())["velocity"]


def default_dtype(kind: str, dtype: Optional[str]) -> str:
    """The generator's choice: the encoder stays fp32 (cheap, and its masks use -inf); the estimator
    takes the requested dtype (``DEFAULT_ESTIMATOR_DTYPE`` when none is)."""
    return "fp32" if kind == "flow_encoder" else (dtype or DEFAULT_ESTIMATOR_DTYPE)
