"""A stateless python-backend model running a torch module on CUDA: the fallback where no engine is built.

It serves the ``estimator`` (or the ``flow_encoder``) of the gpu target with ``--gpu-backend torch``,
with the same tensor names and shapes as the TensorRT plans and the CPU target's ONNX models. The
weights are ``<version>/model.pt`` (written by :func:`save_module`: the module's kind, config and
state dict; loaded with ``weights_only=True``).

Config parameters:

* ``dtype``: ``fp32`` (default), ``bf16`` or ``fp16``. Weights stay fp32; bf16/fp16 run under
  ``torch.autocast``, so matrix products and convolutions use the reduced precision while LayerNorm,
  softmax, the sinusoidal time embedding (``t * 1000`` through ``sin``/``cos``) and the ``-1e10``
  attention-mask arithmetic stay fp32 (a plain ``.half()`` of the module turns that bias into ``-inf``).
* ``FORCE_CPU_ONLY_INPUT_TENSORS: "no"`` (written by the generator): BLS inputs that live on the GPU
  arrive on the GPU, and outputs go back by DLPack without a host copy.

The instance's device comes from its instance group (``KIND_GPU`` -> ``cuda:<device id>``; ``KIND_CPU``
-> ``cpu``, which the CPU tests use). Everything but ``TritonPythonModel`` is importable without Triton.
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
from torch.utils import dlpack

from s3flow.runtime.devices import instance_device

try:  # only inside the Triton stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # tests, scripts/gpu_check.py
    pb_utils = None

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("estimator", "flow_encoder")
INPUTS = {"estimator": ("x", "mask", "mu", "t", "spks", "cond", "r"),
          "flow_encoder": ("tokens", "token_len", "embedding")}
OUTPUTS = {"estimator": ("velocity",), "flow_encoder": ("mu", "mask", "spks")}
WEIGHTS_FILE = "model.pt"


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

    def __init__(self, module: nn.Module, kind: str, device: str | torch.device = "cpu", dtype: str = "fp32"):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.kind, self.dtype, self.device = kind, dtype, torch.device(device)
        self.module = module.to(self.device).float().eval()
        self.meanflow = bool(getattr(getattr(module, "config", None), "meanflow", False))

    @property
    def input_names(self) -> tuple:
        names = INPUTS[self.kind]
        return names if self.kind != "estimator" or self.meanflow else names[:-1]

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
        return {name: o.float() for name, o in zip(OUTPUTS[self.kind], out)}

    def estimator(self, x, mask, mu, t, spks, cond, r=None) -> torch.Tensor:
        """The solver's estimator signature (for in-process use: tests, gpu_check)."""
        return self(x=x, mask=mask, mu=mu, t=t, spks=spks, cond=cond, r=r)["velocity"]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        try:
            settings = TorchModelSettings.from_args(params, args.get("model_instance_kind", "CPU"),
                                                    args.get("model_instance_device_id", 0))
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"{self.name}: {exc}") from None
        if settings.device.startswith("cuda") and not torch.cuda.is_available():
            raise pb_utils.TritonModelException(f"{self.name}: KIND_GPU instance but torch sees no CUDA device")
        path = os.path.join(args["model_repository"], args["model_version"], WEIGHTS_FILE)
        if not os.path.isfile(path):
            raise pb_utils.TritonModelException(f"{self.name}: weights not found at {path}")
        kind, module = load_module(path)
        self.runner = TorchRunner(module, kind, settings.device, settings.dtype)
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]
        want_in, want_out = set(self.runner.input_names), set(OUTPUTS[kind])
        if set(self.inputs) != want_in or set(self.outputs) != want_out:
            raise pb_utils.TritonModelException(
                f"{self.name}: config tensors {self.inputs} -> {self.outputs} do not match the {kind} "
                f"module's {sorted(want_in)} -> {sorted(want_out)}")
        if settings.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(settings.device))
        pb_utils.Logger.log_info(f"{self.name}: torch {kind} on {settings.device}, {settings.dtype}")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                feeds = {}
                for name in self.inputs:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is None:
                        raise ValueError(f"{self.name}: missing input {name}")
                    feeds[name] = dlpack.from_dlpack(tensor.to_dlpack())
                out = self.runner(**feeds)
                tensors = [pb_utils.Tensor.from_dlpack(n, dlpack.to_dlpack(out[n].contiguous()))
                           for n in self.outputs]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # one bad request must not fail the others
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"{self.name}: {exc}")))
        return responses

    def finalize(self):
        self.runner = None


def default_dtype(kind: str, dtype: Optional[str]) -> str:
    """The generator's choice: the encoder stays fp32 (cheap, and its masks use -inf); the estimator
    takes the requested dtype."""
    return "fp32" if kind == "flow_encoder" else (dtype or "fp32")
