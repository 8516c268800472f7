"""ONNX export of the S3Gen flow networks, with onnxruntime parity checks.

Estimator (:class:`s3flow.model.estimator.ConditionalDecoder`), exported by
:func:`export_estimator` with the TorchScript exporter (``dynamo=False``, opset 17).
All tensors are float32 (the model's dtype); ``B`` (axis name ``batch``) and
``T`` (axis name ``time``) are dynamic; ``n_feats`` = 80.

======== ================== ==================================================
name     shape              meaning
======== ================== ==================================================
x        (B, n_feats, T)    current noisy mel
mask     (B, 1, T)          1.0 on valid frames, 0.0 on padding
mu       (B, n_feats, T)    encoder output (upsampled tokens)
t        (B,)               flow time in [0, 1]
spks     (B, n_feats)       projected speaker embedding
cond     (B, n_feats, T)    prompt mel (zeros outside the prompt)
r        (B,)               end time; *meanflow models only*
velocity (B, n_feats, T)    output: predicted dx/dt, zero on padded frames
======== ================== ==================================================

Inputs appear in the graph in exactly the order above (``r`` last, only for
mean-flow models). Names, order and dynamic axes come from ``s3flow_contract.tensors``
(``estimator_inputs`` / ``ESTIMATOR_OUTPUTS``).

The **cached** graph (``export_estimator(..., cached=True)``: what the estimator serves when the solver keeps what
streams solved, ``keep_solved``) also takes the frames before each row from a prefix cache and returns its rows'
first ``keep`` frames' (``s3flow.model.prefix_cache``; the contract's ``CACHE_INPUTS`` / ``CACHE_OUTPUTS``): one
flat float32 input ``past`` (the cache of P frames per row and each row's keep, ``CacheShape.pack_past``) and one
flat output ``kept`` (K = max(keep, 1) frames per row, ``CacheShape.pack_kept``); their lengths are the axes
``past`` and ``kept``, P and K computed from them in the graph.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Dict, List, Tuple, Union

import numpy as np
import torch

from s3flow_contract import tensors as contract
from s3flow.model.encoder import FlowEncoder, random_encoder_inputs
from s3flow.model.estimator import ConditionalDecoder
from s3flow.model.prefix_cache import CacheShape, PrefixCache

__all__ = [
    "ESTIMATOR_OUTPUT_NAME",
    "estimator_input_names",
    "dynamic_axes",
    "export_estimator",
    "check_estimator_onnx",
    "make_estimator_inputs",
    "export_encoder",
    "check_encoder_onnx",
]

PathLike = Union[str, "os.PathLike[str]"]

#: Output tensor name of the estimator graph (the contract's).
[ESTIMATOR_OUTPUT_NAME] = contract.names(contract.ESTIMATOR_OUTPUTS)


def dynamic_axes(tensors, length_axis: str) -> Dict[str, Dict[int, str]]:
    """``torch.onnx.export``'s dynamic axes from the contract's dims: a ``-1`` first dim is ``batch``, any
    other ``-1`` is ``length_axis``."""
    return {t.name: {k: "batch" if k == 0 else length_axis for k, d in enumerate(t.dims) if d == -1}
            for t in tensors}


# --------------------------------------------------------------------------- #
# Estimator
# --------------------------------------------------------------------------- #
def estimator_input_names(meanflow: bool, cached: bool = False) -> List[str]:
    """Graph input names, in order: x, mask, mu, t, spks, cond (+ r if ``meanflow``) (+ the cache's), from the
    contract."""
    return list(contract.names(contract.estimator_inputs(meanflow, cached)))


#: the cache tensors' dynamic axes
CACHE_AXES = {"past": {0: "past"}, "kept": {0: "kept"}}


class CachedGraph(torch.nn.Module):
    """The estimator with the prefix cache packed flat in and out (``past``, ``kept``): the cached graph; with
    ``keeps`` False the read-only one (``past`` in, its keeps ignored, no ``kept``: none of the keeping's nodes)."""

    def __init__(self, model: ConditionalDecoder, keeps: bool = True):
        super().__init__()
        self.model, self.keeps = model, keeps
        self.shape = CacheShape.of(model.config)

    def forward(self, x, mask, mu, t, spks, cond, *rest):
        r = rest[0] if self.model.meanflow else None
        cache, keep = self.shape.unpack_past(rest[-1], torch._shape_as_tensor(x)[0])
        if not self.keeps:
            return self.model(x, mask, mu, t, spks, cond, r, past=cache, keep=None)
        v, kept = self.model(x, mask, mu, t, spks, cond, r, past=cache, keep=keep)
        return v, self.shape.pack_kept(kept)


def make_cache_inputs(model: ConditionalDecoder, batch: int, past_frames: int, keep: List[int],
                      seed: int = 0) -> Dict[str, torch.Tensor]:
    """A random ``past``: ``past_frames`` past frames per row (the last row's half masked), ``keep`` per row."""
    shape = CacheShape.of(model.config)
    g = torch.Generator().manual_seed(seed)
    kv = (shape.layers, batch, shape.heads, past_frames, shape.head_dim)
    mask = torch.ones(batch, 1, past_frames)
    mask[-1, :, past_frames - past_frames // 2:] = 0.0
    cache = PrefixCache(torch.randn(kv, generator=g), torch.randn(kv, generator=g),
                        torch.randn(shape.convs, batch, shape.width, shape.tail, generator=g), mask)
    p = next(model.parameters())
    return {"past": shape.pack_past(cache, torch.tensor(keep, dtype=torch.int64)).to(device=p.device, dtype=p.dtype)}


def make_estimator_inputs(
    model: ConditionalDecoder,
    batch: int,
    frames: int,
    seed: int = 0,
    lengths: Union[List[int], None] = None,
) -> Dict[str, torch.Tensor]:
    """Random estimator inputs with a padded mask (on the model's device/dtype).

    Args:
        model: The estimator (decides ``n_feats``, ``meanflow``, device, dtype).
        batch: B.
        frames: T (padded length).
        seed: Seed of the private generator.
        lengths: Valid frames per item. Default: item 0 uses all ``frames`` and
            the others shrink linearly to about ``frames // 2`` (a single item
            gets ``frames - frames // 4``), so the mask is always padded.

    Returns:
        Name -> tensor dict, ordered as :func:`estimator_input_names`.
        Padded frames of ``x``/``mu``/``cond`` hold random values too (the
        model must ignore them).
    """
    if lengths is None:
        if batch == 1:
            lengths = [max(1, frames - frames // 4)]
        else:
            lengths = [
                max(1, frames - (i * (frames - frames // 2)) // (batch - 1)) for i in range(batch)
            ]
    if len(lengths) != batch:
        raise ValueError("len(lengths) must equal batch")
    g = torch.Generator().manual_seed(seed)
    n = model.config.n_feats
    mask = (torch.arange(frames)[None, :] < torch.tensor(lengths)[:, None]).float().unsqueeze(1)
    values = [torch.randn(batch, n, frames, generator=g), mask,                    # x, mask
              torch.randn(batch, n, frames, generator=g), torch.rand(batch, generator=g),  # mu, t
              torch.randn(batch, n, generator=g), torch.randn(batch, n, frames, generator=g)]  # spks, cond
    if model.meanflow:
        values.append(torch.rand(batch, generator=g))                               # r
    inputs = dict(zip(estimator_input_names(model.meanflow), values))
    p = next(model.parameters())
    return {k: v.to(device=p.device, dtype=p.dtype) for k, v in inputs.items()}


def export_estimator(model: ConditionalDecoder, path: PathLike, opset: int = 17, cached: bool = False,
                     keeps: bool = True) -> Path:
    """Exports the estimator to a single ONNX file with dynamic batch/time axes (``cached``: the cached graph, the
    module docstring; ``keeps`` False: its read-only variant, ``velocity`` out only).

    The graph is traced at B=2, T=48 (small, fast); the axes named ``batch``
    and ``time`` are dynamic. See the module docstring for tensor names.

    Args:
        model: The estimator to export (exported in eval mode; its mode is restored).
        path: Output ``.onnx`` file (parent directories are created).
        opset: ONNX opset version (>= 17 needed for ``LayerNormalization``).

    Returns:
        The output path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = estimator_input_names(model.meanflow, cached)
    dummy = make_estimator_inputs(model, batch=2, frames=48, seed=0)
    axes = dynamic_axes(contract.estimator_inputs(model.meanflow) + contract.ESTIMATOR_OUTPUTS, "time")
    if cached:
        dummy.update(make_cache_inputs(model, batch=2, past_frames=5, keep=[7, 3] if keeps else [0, 0]))
        axes.update(CACHE_AXES)
        model = CachedGraph(model, keeps)
    args: Tuple[torch.Tensor, ...] = tuple(dummy[n] for n in names)
    outputs = contract.names(contract.estimator_outputs(cached and keeps))
    return _export(model, args, path, opset, names, list(outputs), axes)


def _export(model: torch.nn.Module, args: tuple, path: Path, opset: int, input_names, output_names,
            axes: Dict[str, Dict[int, str]]) -> Path:
    """``torch.onnx.export`` (TorchScript exporter) in eval mode and no_grad; the model's mode is restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # F.pad (causal convs, the encoder's padding) exports as Pad fed by a tiny constant subgraph with
            # a step -1 Slice that the TorchScript exporter cannot fold; onnxruntime and TensorRT fold it
            # when the graph is loaded. Benign, so silenced.
            warnings.filterwarnings("ignore", message="Constant folding - Only steps=1")
            torch.onnx.export(model, args, str(path), dynamo=False, opset_version=opset,
                              input_names=list(input_names), output_names=list(output_names),
                              dynamic_axes=axes, do_constant_folding=True)
    finally:
        model.train(was_training)
    return path


def check_estimator_onnx(
    model: ConditionalDecoder,
    path: PathLike,
    batch: int = 2,
    frames: int = 300,
    seed: int = 0,
) -> float:
    """Runs the exported graph in onnxruntime (CPU) and the model in torch.

    Inputs are fresh random tensors with a padded mask (see
    :func:`make_estimator_inputs`), at a shape different from the export trace; a cached graph also gets a
    random cache (:func:`make_cache_inputs`) and every output is compared.

    Args:
        model: The estimator the file was exported from.
        path: The ``.onnx`` file.
        batch: B of the check.
        frames: T of the check.
        seed: Seed for the random inputs.

    Returns:
        Worst absolute difference between onnxruntime and torch over all outputs.
    """
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cached = "past" in {i.name for i in sess.get_inputs()}   # the cached graph (keep_solved)
    inputs = make_estimator_inputs(model, batch=batch, frames=frames, seed=seed)
    if cached:
        inputs.update(make_cache_inputs(model, batch, past_frames=frames // 3, keep=[frames // 2] * batch, seed=seed))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ref = CachedGraph(model)(*inputs.values()) if cached else (model(**inputs),)
    finally:
        model.train(was_training)

    feed = {k: v.cpu().numpy() for k, v in inputs.items()}
    outs = sess.run(None, feed)
    worst = 0.0
    for out, want in zip(outs, ref):
        want = want.float().cpu().numpy()
        if out.shape != want.shape:
            raise AssertionError(f"onnx output shape {out.shape} != torch {want.shape}")
        worst = max(worst, float(np.max(np.abs(out.astype(np.float32) - want))))
    return worst


# --------------------------------------------------------------------------- #
# Encoder: inputs tokens (B, N) int64, token_len (B,) int64, embedding (B, 192); outputs mu (B, n_feats, 2N),
# mask (B, 1, 2N), spks (B, n_feats), as FlowEncoder.forward
# --------------------------------------------------------------------------- #
ENCODER_INPUT_NAMES = contract.names(contract.ENCODER_INPUTS)
ENCODER_OUTPUT_NAMES = contract.names(contract.ENCODER_OUTPUTS)


def export_encoder(model: FlowEncoder, path: PathLike, opset: int = 17) -> Path:
    """Export to ONNX (TorchScript exporter) with dynamic batch and token axes.

    Inputs ``tokens`` (B, N) int64, ``token_len`` (B,) int64, ``embedding`` (B, 192) float32; outputs
    ``mu`` (B, n_feats, 2N), ``mask`` (B, 1, 2N), ``spks`` (B, n_feats), as ``FlowEncoder.forward``.
    The graph runs for any N with ``2N <= pos_enc_max_len``.

    Args:
        model: The encoder (exported in eval mode, on its current device).
        path: Output ``.onnx`` file.
        opset: ONNX opset.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    args = tuple(a.to(device) for a in random_encoder_inputs(model.config, batch=2, n_tokens=13, seed=0))
    axes = {**dynamic_axes(contract.ENCODER_INPUTS, "tokens"), **dynamic_axes(contract.ENCODER_OUTPUTS, "frames")}
    return _export(model, args, path, opset, ENCODER_INPUT_NAMES, ENCODER_OUTPUT_NAMES, axes)


def check_encoder_onnx(model: FlowEncoder, path: PathLike, seed: int = 0) -> float:
    """Worst absolute difference of ONNX Runtime (CPU) against torch on random padded batches.

    Runs two shapes unlike the export's (B=1, N=7 and B=3, N=23) and compares all three outputs.

    Args:
        model: The torch encoder the file was exported from.
        path: The ``.onnx`` file.
        seed: Seed for the random inputs.

    Returns:
        Max |onnx - torch| over mu, mask and spks and both shapes.
    """
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    worst = 0.0
    try:
        for i, (batch, n) in enumerate([(1, 7), (3, 23)]):
            inputs = random_encoder_inputs(model.config, batch, n, seed=seed + i)
            with torch.no_grad():
                ref = model(*(a.to(device) for a in inputs))
            got = sess.run(list(ENCODER_OUTPUT_NAMES),
                           {name: a.numpy() for name, a in zip(ENCODER_INPUT_NAMES, inputs)})
            for r, g in zip(ref, got):
                if tuple(r.shape) != g.shape:
                    raise AssertionError(f"ONNX output shape {g.shape} != torch {tuple(r.shape)}")
                worst = max(worst, float(np.abs(r.float().cpu().numpy() - g).max()))
    finally:
        model.train(was_training)
    return worst
