"""The python-backend model serving the estimator (or flow_encoder) in torch on CUDA with ``--gpu-backend
torch`` (s3flow.runtime.torch_runner), with the same tensor names and shapes as the TensorRT plans.

``FORCE_CPU_ONLY_INPUT_TENSORS: "no"`` (written by the generator): BLS inputs that live on the GPU arrive on the
GPU, and outputs go back by DLPack without a host copy.
"""
from __future__ import annotations

import json
import os

import torch
from torch.utils import dlpack

from s3flow.runtime.torch_runner import OUTPUTS, WEIGHTS_FILE, TorchModelSettings, TorchRunner, load_module

try:  # only inside the Triton stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # tests
    pb_utils = None


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
