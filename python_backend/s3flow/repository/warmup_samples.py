"""Triton's ``model_warmup`` samples, as ``ModelWarmup`` messages over the contract's tensors: those of the stateless
models (``flow_encoder``, ``estimator``), which warm them up (the in-process warm-up of the sequence-batched
models, and why the two differ: ``s3flow.serving.warmup``), and the solver's, which only tells it that Triton has
set its instance up (``solver_set_up``)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from s3flow_contract.tensors import CACHE_INPUTS, ENCODER_INPUTS, REQUEST, by_name, estimator_inputs
from s3flow.repository.model_config import read_config, write_config
from s3flow.serving.warmup import WARMUP_TOKENS

#: Triton runs each ``model_warmup`` sample this many times (the second run of ONNX Runtime is the steady one).
WARMUP_ITERATIONS = 2
#: The folder of a model's warm-up data files (``input_data_file`` is read from there).
WARMUP_DIR = "warmup"
#: The tensors a warm-up gives real values: token ids 0 (valid), their true length, a mask of ones.
_TOKENS, _TOKEN_LEN = (by_name(ENCODER_INPUTS)[n].name for n in ("tokens", "token_len"))
_MASK = by_name(estimator_inputs(False))["mask"].name



def _sample(name: str, tensors: tuple, n_feats: int, batch: int, length: int, iterations: int,
            data: dict, file_names: Optional[dict] = None) -> tuple[mc.ModelWarmup, dict[str, bytes]]:
    """One ``model_warmup`` sample over the contract's ``tensors``: dims with the first ``-1`` as ``batch``,
    the others as ``length``; ``data``: {tensor: "zero" | a numpy array}, random data for the rest (a flat
    tensor given an array takes the array's length); ``file_names``: a data file's name other than its tensor's. Returns
    the sample and its data files ({path in the model folder: bytes})."""
    names = file_names or {}
    sample = mc.ModelWarmup(name=name, batch_size=1, count=iterations)
    files = {}
    for t in tensors:
        dims = [batch if i == 0 and d == -1 else (length if d == -1 else d) for i, d in enumerate(t.shape(n_feats))]
        if t.shape(n_feats) == (-1,) and isinstance(data.get(t.name), np.ndarray):
            dims = [int(data[t.name].size)]
        spec = sample.inputs[t.name]
        spec.data_type = mc.DataType.Value(t.config_type)
        spec.dims.extend(dims)
        given = data.get(t.name)
        if given is None:
            spec.random_data = True
        elif isinstance(given, str) and given == "zero":
            spec.zero_data = True
        else:
            array = np.ascontiguousarray(np.broadcast_to(np.asarray(given, dtype=t.np_dtype), dims))
            spec.input_data_file = names.get(t.name, t.name)
            files[f"{WARMUP_DIR}/{spec.input_data_file}"] = array.tobytes()
    return sample, files


def encoder_warmup(tokens: int = WARMUP_TOKENS, iterations: int = WARMUP_ITERATIONS
                   ) -> tuple[mc.ModelWarmup, dict[str, bytes]]:
    """The ``model_warmup`` sample of ``flow_encoder``: one utterance of ``tokens`` token ids 0, its true
    length in the data file ``warmup/token_len`` (a zero length would be a request no client sends)."""
    return _sample(f"tokens_{tokens}", ENCODER_INPUTS, 0, 1, tokens, iterations,
                   {_TOKENS: "zero", _TOKEN_LEN: np.array([tokens])})


def estimator_warmup(n_feats: int, meanflow: bool, frames: int = 2 * WARMUP_TOKENS,
                     iterations: int = WARMUP_ITERATIONS, cache=None,
                     graph: str = "cached") -> tuple[mc.ModelWarmup, dict[str, bytes]]:
    """The ``model_warmup`` sample of ``estimator``: one Euler step's call for one sequence, ``frames`` long
    (2 rows, as classifier-free guidance calls it; 1 for meanflow); the mask (``warmup/mask``) is all ones,
    so every frame is computed. With ``cache`` (a ``CacheShape``: the estimator serves the cached graph,
    ``keep_solved``) the call is a stream's first chunk's: it reads a cache of one masked frame, as a call
    whose rows read none does, and keeps its first half (``warmup/past``); without it the first real stream on a
    new server paid the cached graph's first run (its first audio 474-536 ms against 227 without keeping).
    ``graph``, beside a served cached graph (``RepositorySettings.graphs_by_call``): ``plain``, a call whose rows
    read no cache and keep nothing (an empty ``past``, ``warmup/past_empty``), ``read``, one that keeps nothing
    (``warmup/past_read``), each served by its own graph."""
    rows = 1 if meanflow else 2
    data = {_MASK: np.ones(1)}
    if graph == "plain":
        data[CACHE_INPUTS[0].name] = np.zeros(0, np.float32)
        return _sample(f"rows_{rows}_frames_{frames}_plain", estimator_inputs(meanflow, cached=True), n_feats, rows,
                       frames, iterations, data, file_names={CACHE_INPUTS[0].name: "past_empty"})
    if cache is not None:
        import torch

        from s3flow.model.prefix_cache import PrefixCache

        empty = PrefixCache.empty(cache, rows, torch.zeros(1))
        keep = 0 if graph == "read" else frames // 2
        data[CACHE_INPUTS[0].name] = cache.pack_past(empty, torch.full((rows,), keep)).numpy()
    suffix = "_read" if graph == "read" else ""
    return _sample(f"rows_{rows}_frames_{frames}{suffix}", estimator_inputs(meanflow, cached=cache is not None),
                   n_feats, rows, frames, iterations, data,
                   file_names={CACHE_INPUTS[0].name: "past_read"} if suffix else None)


def solver_set_up() -> tuple[mc.ModelWarmup, dict[str, bytes]]:
    """The ``model_warmup`` sample of ``cfm_solver``: one request of one token and no sequence controls (READY
    reads 0, so the solver answers it empty and no state is made). Triton sends it once the instance is set up,
    before the model is ready; its ``execute`` tells the solver that BLS calls from its own threads are safe
    from now on (``s3flow.serving.calibration``)."""
    speech = by_name(REQUEST)["speech_tokens"]
    return _sample("set_up", (speech,), 0, 1, 1, 1, {speech.name: "zero"})


def add_model_warmup(config: mc.ModelConfig, n_feats: int, meanflow: bool, cache=None,
                     graphs: bool = False) -> dict[str, bytes]:
    """Add the warm-up sample of ``config``'s model (``flow_encoder``, ``estimator`` or ``cfm_solver``) to it;
    return the data files the sample reads ({path in the model folder: bytes}). ``cache``: the estimator's
    ``CacheShape`` where it serves the cached graph; ``graphs``: it serves the plain and read-only graphs beside it
    (``RepositorySettings.graphs_by_call``: a sample each)."""
    if config.model_warmup:
        raise ValueError(f"{config.name}'s config has a model_warmup already")
    if config.name == "flow_encoder":
        sample, files = encoder_warmup()
    elif config.name == "estimator":
        sample, files = estimator_warmup(n_feats, meanflow, cache=cache)
        for graph in ("plain", "read") if cache is not None and graphs else ():
            other, more = estimator_warmup(n_feats, meanflow, cache=cache, graph=graph)
            config.model_warmup.append(other)
            files = {**files, **more}
    elif config.name == "cfm_solver":
        sample, files = solver_set_up()
    else:
        raise ValueError(f"no model_warmup sample for {config.name!r} (flow_encoder, estimator and cfm_solver "
                         f"have one)")
    config.model_warmup.append(sample)
    return files


def write_model_warmup(repository: Path, n_feats: int, meanflow: bool) -> list[Path]:
    """Add ``model_warmup`` to the configs of ``flow_encoder`` and ``estimator`` in ``repository`` and write
    their ``warmup/`` data files; return the files written."""
    written = []
    for name in ("flow_encoder", "estimator"):
        folder = Path(repository) / name
        config = read_config(folder)
        files = add_model_warmup(config, n_feats, meanflow)
        written.append(write_config(folder, config))
        for rel, data in sorted(files.items()):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
            written.append(folder / rel)
    return written
