"""ONNX Runtime sessions (``s3flow.runtime.ort``) as the in-process engine's estimator and encoder: torch tensors
in and out, shared with numpy (no copy). Benchmarks and tests run the served graphs in process with these; the
served models call the sessions directly (no torch in their stubs).

Example::

    from s3flow.engine.streaming import StreamingEngine
    from s3flow.runtime.ort_engine import OrtEncoder, OrtEstimator
    estimator = OrtEstimator("model_repository/estimator/1/model.onnx", threads=2)
    encoder = OrtEncoder("model_repository/flow_encoder/1/model.onnx", threads=2)
    engine = StreamingEngine(encoder, estimator, n_feats=80, meanflow=estimator.meanflow)
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np
import torch

from s3flow_contract import tensors as contract
from s3flow.model.solver import EstimatorInputs
from s3flow.runtime.ort import OrtModel, OrtSettings


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").contiguous().numpy()


class OrtEstimator:
    """The estimator ONNX file as a solver Estimator: ``velocity = est(inputs: EstimatorInputs)``.

    torch tensors in and out, shared with numpy (no copy). With ``io_binding`` the velocity is written into
    a buffer reused from call to call (the solver consumes it before the next step); set ``copy_outputs``
    to keep each.
    """

    def __init__(self, path: str | os.PathLike, settings: Optional[OrtSettings] = None, *,
                 threads: Optional[int] = None, io_binding: bool = False, copy_outputs: bool = False):
        if threads is not None:
            settings = dataclasses.replace(settings or OrtSettings(), threads=threads)
        self.model = OrtModel(path, settings, io_binding=io_binding)
        self.meanflow = contract.MEANFLOW_INPUT.name in self.model.inputs
        self.names = contract.names(contract.estimator_inputs(self.meanflow))
        [self.output] = contract.names(contract.ESTIMATOR_OUTPUTS)
        self.copy_outputs = copy_outputs

    def __call__(self, inputs: EstimatorInputs) -> torch.Tensor:
        if inputs.meanflow != self.meanflow:
            raise ValueError(f"this estimator {'needs' if self.meanflow else 'takes no'} r (meanflow)")
        feeds = {name: _np(a) for name, a in inputs.named().items()}
        [v] = self.model.run(feeds, out_shapes={self.output: tuple(inputs.x.shape)}, outputs=[self.output],
                             copy_outputs=self.copy_outputs)
        return torch.from_numpy(v)


class OrtEncoder:
    """The flow-encoder ONNX file as the engine's ``encode(tokens, token_len, embedding) -> (mu, mask, spks)``."""

    def __init__(self, path: str | os.PathLike, settings: Optional[OrtSettings] = None, *,
                 threads: Optional[int] = None, io_binding: bool = False):
        if threads is not None:
            settings = dataclasses.replace(settings or OrtSettings(), threads=threads)
        self.model = OrtModel(path, settings, io_binding=io_binding)

    def __call__(self, tokens, token_len, embedding):
        names = contract.names(contract.ENCODER_INPUTS)
        feeds = {name: _np(a) for name, a in zip(names, (tokens, token_len, embedding))}
        mu, mask, spks = self.model.run(feeds, outputs=list(contract.names(contract.ENCODER_OUTPUTS)))
        return torch.from_numpy(mu), torch.from_numpy(mask), torch.from_numpy(spks)
