"""Running a TensorRT engine with torch CUDA tensors as its buffers, and the estimator engine as a solver
estimator. Tensor names are the contract's (``s3flow_contract.tensors``): the engines are built from ONNX exports
named by it."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from s3flow_contract import tensors as contract
from s3flow.runtime.tensorrt.build import EngineBuildError

[VELOCITY] = contract.names(contract.ESTIMATOR_OUTPUTS)


class TrtEngine:
    """A deserialized engine with one execution context; call with torch tensors by input name.

    Inputs are moved/cast to the engine's device and dtypes; outputs come back as torch tensors on the
    device. Not thread-safe (one context).
    """

    def __init__(self, path: str | os.PathLike, device: int = 0):
        import tensorrt as trt

        self.trt, self.device = trt, torch.device("cuda", device)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        with torch.cuda.device(self.device):
            self.engine = self.runtime.deserialize_cuda_engine(Path(path).read_bytes())
            if self.engine is None:
                raise EngineBuildError(f"could not load {path}: built by another TensorRT version or for "
                                       "another GPU? Rebuild it here (scripts/build_engines.py)")
            self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) != mode]
        self._dtypes = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
                        trt.bool: torch.bool}
        for extra, tdtype in (("int64", torch.int64), ("bfloat16", torch.bfloat16)):
            if hasattr(trt, extra):
                self._dtypes[getattr(trt, extra)] = tdtype

    def dtype(self, name: str) -> torch.dtype:
        return self._dtypes[self.engine.get_tensor_dtype(name)]

    def __call__(self, **feeds: torch.Tensor) -> dict[str, torch.Tensor]:
        missing = set(self.inputs) - set(feeds)
        if missing:
            raise ValueError(f"engine inputs missing: {sorted(missing)}")
        keep = []
        for name in self.inputs:
            t = feeds[name].to(self.device, self.dtype(name)).contiguous()
            keep.append(t)
            if not self.context.set_input_shape(name, tuple(t.shape)):
                raise ValueError(f"input {name} shape {tuple(t.shape)} is outside the engine's profile")
            self.context.set_tensor_address(name, t.data_ptr())
        out = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            buf = torch.empty(shape, dtype=self.dtype(name), device=self.device)
            self.context.set_tensor_address(name, buf.data_ptr())
            out[name] = buf
        stream = torch.cuda.current_stream(self.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise EngineBuildError("TensorRT execute_async_v3 failed")
        return out


class TrtEstimator:
    """A TensorRT estimator engine as a solver estimator: ``velocity = est(inputs: EstimatorInputs)`` (fp32
    out; ``r`` only for meanflow engines)."""

    def __init__(self, engine: TrtEngine):
        self.engine = engine

    def __call__(self, inputs) -> torch.Tensor:
        return self.engine(**inputs.named())[VELOCITY].float()
