"""The python-backend model serving the estimator (or flow_encoder) in torch on CUDA with ``--gpu-backend
torch`` (s3flow.runtime.torch_runner), with the same tensor names and shapes as the TensorRT plans.

The weights file (``<version>/model.pt``) says which model it is (and whether the estimator is meanflow); the
config must declare that model's contract tensors. ``FORCE_CPU_ONLY_INPUT_TENSORS: "no"`` (written by the
generator): BLS inputs that live on the GPU arrive on the GPU, and outputs go back by DLPack without a host copy.
"""
from __future__ import annotations

import os

import torch
from torch.utils import dlpack

from s3flow_contract.tensors import names
from s3flow.protocol import RequestError
from s3flow.runtime.torch_runner import WEIGHTS_FILE, TorchModelSettings, TorchRunner, load_module
from s3flow_contract.tensors import stateless_tensors
from s3flow.serving.triton_models.base import TritonModel, pb_utils


class TritonPythonModel(TritonModel):
    def setup(self, args):
        settings = TorchModelSettings.from_args(self.params.raw, self.instance_kind, self.device_id)
        if settings.device.startswith("cuda") and not torch.cuda.is_available():
            raise self.load_error("KIND_GPU instance but torch sees no CUDA device")
        path = os.path.join(self.version_dir, WEIGHTS_FILE)
        if not os.path.isfile(path):
            raise self.load_error(f"weights not found at {path}")
        kind, module = load_module(path)
        cached = any(i.get("name") == "past" for i in self.config.get("input", []))   # (keep_solved)
        self.runner = TorchRunner(module, kind, settings.device, settings.dtype, cached=cached)
        inputs, outputs = stateless_tensors(kind, self.runner.meanflow, cached)
        self.check_contract(inputs, outputs)
        self.inputs, self.outputs = names(inputs), names(outputs)
        if settings.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(settings.device))
        self.logger.log_info(f"{self.name}: torch {kind} on {settings.device}, {settings.dtype}")

    def respond(self, request):
        feeds = {}
        for name in self.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                raise RequestError(f"missing input {name}")
            feeds[name] = dlpack.from_dlpack(tensor.to_dlpack())
        out = self.runner(**feeds)
        tensors = [pb_utils.Tensor.from_dlpack(n, dlpack.to_dlpack(out[n].contiguous())) for n in self.outputs]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.runner = None
