"""Requests on the wire: numpy tensors as tritonclient inputs, typed by their declarations in ``s3flow_contract.tensors``.

Request tensors are built by ``s3flow_contract.tensors.request_arrays`` (``Utterance.request`` for a chunk of an
utterance); :func:`infer_inputs` turns any model's tensors into ``InferInput`` objects with the wire type the
contract declares for each name, and refuses a name or dtype the contract does not declare::

    from s3flow_contract.tensors import request_arrays
    inputs = infer_inputs(request_arrays(tokens, start=True, prompt_tokens=pt, prompt_mel=pm,
                                         speaker_embedding=xv, seed=0))
    client.infer("token2mel", inputs, sequence_id=1, sequence_start=True, sequence_end=True,
                 outputs=requested_outputs(MEL_RESPONSE))
"""
from __future__ import annotations

import functools

from typing import Iterable, Mapping

import numpy as np
import tritonclient.grpc as grpcclient

from s3flow_contract.tensors import REQUEST, Tensor, by_name


@functools.lru_cache(maxsize=16)
def _spec(tensors: tuple) -> dict:
    return by_name(tensors)


def infer_inputs(arrays: Mapping[str, np.ndarray], tensors: Iterable[Tensor] = REQUEST) -> list:
    """One ``InferInput`` per array, with the wire type ``tensors`` (default: the public request) declares.

    Raises:
        ValueError: a name ``tensors`` does not declare, or an array whose dtype is not the declared one.
    """
    spec = _spec(tuple(tensors))
    inputs = []
    for name, value in arrays.items():
        t = spec.get(name)
        if t is None:
            raise ValueError(f"{name} is not an input of this model; its inputs are {sorted(spec)}")
        value = np.ascontiguousarray(value)
        if value.dtype != t.np_dtype:
            raise ValueError(f"{name} must be {t.dtype}, got {value.dtype}")
        tensor = grpcclient.InferInput(name, list(value.shape), t.wire_type)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def requested_outputs(tensors: Iterable[Tensor]) -> list:
    """``InferRequestedOutput`` objects for the declared outputs ``tensors``."""
    return [grpcclient.InferRequestedOutput(t.name) for t in tensors]
