"""The solver's calls into other Triton models over BLS: the engine's encoder and estimator, run by ``flow_encoder``
and ``estimator`` (ONNX Runtime on CPU hosts, TensorRT plans on GPU hosts). Tensors cross by DLPack (no copy); on a
GPU instance the outputs are asked for in its GPU's memory, so the Euler loop never leaves the device. A call under
a traced request shows in Triton's trace as its child (:meth:`BlsModel.traced`).

Example (the solver's ``setup``)::

    encoder = BlsEncoder("flow_encoder", names(ENCODER_INPUTS), names(ENCODER_OUTPUTS))
    mu, mask, spks = encoder(tokens, token_len, embedding)
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
from torch.utils import dlpack

from s3flow.model.prefix_cache import CacheShape, PrefixCache
from s3flow.serving.session import ModelCallError
from s3flow.serving.triton_models.base import pb_utils


def _to_triton(name: str, t: torch.Tensor):
    return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(t.contiguous()))


def _to_torch(tensor) -> torch.Tensor:
    return dlpack.from_dlpack(tensor.to_dlpack())


class BlsModel:
    """Call another Triton model by name with tensors named as its contract names them; check the response for
    errors; return its contract outputs as torch tensors. ``BlsEncoder`` and ``BlsEstimator`` give it the
    engine's encoder and estimator signatures."""

    def __init__(self, model_name: str, inputs: tuple[str, ...], outputs: tuple[str, ...],
                 device_id: int | None = None):
        self.model_name, self.inputs, self.outputs = model_name, inputs, outputs
        self.output_list = list(outputs)
        # the traced request this thread's calls belong to (Triton's tracing shows them as its children): per
        # thread, as the calibration thread calls too, and a trace outlives neither its request nor its execute
        # (a call under a finished request's trace crashed tritonserver: SIGSEGV in TRITONSERVER_ServerInferAsync)
        self._traced = threading.local()
        # on a GPU instance, ask for outputs in that GPU's memory: the Euler loop never leaves the device
        self.memory = ({} if device_id is None else
                       {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device_id)})

    @contextlib.contextmanager
    def traced(self, trace):
        """This thread's calls inside the block are children of ``trace`` (None: untraced)."""
        self._traced.trace = trace
        try:
            yield
        finally:
            self._traced.trace = None

    def call(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if tuple(tensors) != self.inputs:  # a bug of the caller, not of the callee: INTERNAL
            raise TypeError(f"model '{self.model_name}' takes {list(self.inputs)}, got {list(tensors)}")
        if self.memory:  # the callee reads our device buffers on its own stream: finish writing them first
            torch.cuda.current_stream().synchronize()
        request = pb_utils.InferenceRequest(
            model_name=self.model_name, requested_output_names=self.output_list,
            inputs=[_to_triton(k, v) for k, v in tensors.items()], **self.memory,
            **({} if getattr(self._traced, "trace", None) is None else {"trace": self._traced.trace}))
        response = request.exec()
        if response.has_error():
            raise ModelCallError(f"model '{self.model_name}' failed: {response.error().message()}")
        out = []
        for name in self.outputs:
            tensor = pb_utils.get_output_tensor_by_name(response, name)
            if tensor is None:
                raise ModelCallError(f"model '{self.model_name}' returned no output '{name}'")
            out.append(_to_torch(tensor))
        return out


class BlsEncoder(BlsModel):
    """The engine's ``encode(tokens, token_len, embedding) -> (mu, mask, spks)`` over BLS."""

    def __call__(self, tokens: torch.Tensor, token_len: torch.Tensor, embedding: torch.Tensor):
        return self.call(dict(zip(self.inputs, (tokens, token_len, embedding))))


class BlsEstimator(BlsModel):
    """The solver's ``Estimator`` (``EstimatorInputs`` in, velocity out) over BLS. With ``cache`` (the estimator's
    ``CacheShape``: it serves the cached graph, the solver keeps what streams solved) it takes a prefix cache too
    (``carries_prefix``): every call sends one, packed with a keep per row (a masked frame where no row reads any;
    keep 0: none), and returns the kept cache where the inputs asked for one."""

    def __init__(self, model_name: str, inputs: tuple[str, ...], outputs: tuple[str, ...],
                 device_id: int | None = None, cache: Optional[CacheShape] = None, plain: bool = False):
        """``plain``: the estimator serves the plain graph beside the cached one, to a call with an empty
        ``past`` (one whose rows read no cache and keep nothing: one request)."""
        super().__init__(model_name, inputs, outputs, device_id)
        self.cache, self.plain = cache, plain
        self.carries_prefix = cache is not None

    def __call__(self, inputs):
        if self.cache is None:
            return self.call(inputs.named())[0]
        x = inputs.x
        if self.plain and inputs.past is None and inputs.keep is None:
            return self.call({**inputs.named(), "past": x.new_zeros(0)})[0]
        past = inputs.past if inputs.past is not None else PrefixCache.empty(self.cache, x.shape[0], x)
        keep = inputs.keep if inputs.keep is not None else torch.zeros(x.shape[0], dtype=torch.int64)
        v, kept = self.call({**inputs.named(), "past": self.cache.pack_past(past, keep.to(x.device))})
        return v if inputs.keep is None else (v, self.cache.unpack_kept(kept, x.shape[0]))
