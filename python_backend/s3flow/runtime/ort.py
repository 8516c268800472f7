"""ONNX Runtime (CPU) sessions for the exported estimator and encoder, run by tensor name with numpy arrays.

The same code runs in process (``s3flow.runtime.ort_engine``: the sessions as the engine's torch callables) and
inside the Triton python models (``s3flow.serving.triton_models.onnx_model``, which import no torch: a stub
without it starts sooner and holds less memory): :func:`session_options` holds the session settings in one place, and
:class:`OrtModel` runs a session by tensor name (the graph rewritten for the CPU at load where the settings say:
``s3flow.runtime.ort_rewrite``). Inputs are shared with numpy/torch, not copied. With
``io_binding=True`` it binds them in place and, where the caller knows the output shapes, writes outputs
into buffers it keeps; on the CPU provider that measured no faster than plain ``run`` (the binding object
costs about what the output allocation saves: 4.73 vs 4.58 ms median at B = 2, T = 64, small config), so
it is off by default and kept for providers where copies cost more.

Example::

    model = OrtModel("model_repository/estimator/1/model.onnx", OrtSettings(threads=2))
    [velocity] = model.run(feeds, outputs=["velocity"])

Shapes as in ``s3flow.runtime.onnx_export`` (``export_estimator``, ``export_encoder``);
tensor names are the contract's (``s3flow_contract.tensors``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import onnxruntime as ort

from s3flow.runtime.ort_rewrite import RewriteCounts, rewrite_for_cpu

_NP_DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}


@dataclass
class OrtSettings:
    """Session settings (the Triton models read them from config parameters of the same names).

    threads: intra-op threads, 0 = ONNX Runtime's default (one per core).
    spinning: let idle intra-op threads spin for work. Lower latency for back-to-back calls; but a
        spinning pool steals the core from another model's pool on a small host, so the served encoder
        (called once per chunk, between estimator calls) turns it off.
    optimization: graph optimisation level: "all", "extended", "basic" or "disable".
    rewrite: apply ``s3flow.runtime.ort_rewrite.rewrite_for_cpu`` when the session is made (the file on disk is not changed):
        Mish in exp form, and attention as one MultiHeadAttention node where ``fuse_attention`` says.
        Same function in fp32. Measured on the full-size estimator at B = 2 (results/benchmark.md):
        1 thread 1.14x at T = 300 and 1.05x at T = 64; 2 threads (attention fused) 1.05x at T = 300 but
        0.92x at T = 64, where MultiHeadAttention's CPU kernel splits the work across threads worse
        than the separate MatMul / Softmax nodes do.
    fuse_attention: None (default) fuses attention only for a 1-thread session; True / False force it.
    """
    threads: int = 0
    spinning: bool = True
    optimization: str = "all"
    rewrite: bool = True
    fuse_attention: Optional[bool] = None

    @property
    def attention_fused(self) -> bool:
        return self.rewrite and (self.threads == 1 if self.fuse_attention is None else self.fuse_attention)

    def check(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.optimization not in _LEVELS:
            raise ValueError(f"optimization must be one of {sorted(_LEVELS)}, got {self.optimization!r}")


def auto_threads(instances: int = 1, cores: Optional[int] = None) -> int:
    """Intra-op threads for one of ``instances`` sessions of a model sharing this host: the cores this process
    may run on (its CPU affinity: a container's limit shows there), divided among the instances, at least 1.
    ONNX Runtime's own default (one thread per core in every session) makes two instances' pools fight."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, instances))


_LEVELS = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
           "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
           "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
           "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}


def session_options(settings: Optional[OrtSettings] = None) -> ort.SessionOptions:
    s = settings or OrtSettings()
    s.check()
    opts = ort.SessionOptions()
    if s.threads:
        opts.intra_op_num_threads = s.threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = _LEVELS[s.optimization]
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if s.spinning else "0")
    # the memory pattern is planned and cached per input shape: with streaming's ever-changing lengths the
    # cache only grows (measured: +35 MB in the encoder over one 60 s utterance) and saves nothing
    opts.enable_mem_pattern = False
    return opts


class OrtModel:
    """One ONNX file in a CPU session, run by tensor name with numpy arrays.

    ``run(feeds, out_shapes)``: inputs are bound in place (no copy for contiguous arrays of the graph's
    dtype). Outputs whose shape the caller gives are written into buffers this object owns and reuses
    while the shape stays the same; the returned arrays are therefore only valid until the next ``run``
    unless ``copy_outputs`` is set. Other outputs are allocated by ONNX Runtime.
    """

    def __init__(self, path: str | os.PathLike, settings: Optional[OrtSettings] = None,
                 io_binding: bool = False):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"ONNX file not found: {path}")
        self.path = path
        self.settings = settings or OrtSettings()
        source, self.rewrites = str(path), RewriteCounts()
        if self.settings.rewrite:
            import onnx
            model = onnx.load(str(path))
            self.rewrites = rewrite_for_cpu(model, attention=self.settings.attention_fused)
            if self.rewrites.mish or self.rewrites.attention:
                source = model.SerializeToString()
            del model
        self.session = ort.InferenceSession(source, sess_options=session_options(self.settings),
                                            providers=["CPUExecutionProvider"])
        self.inputs = {i.name: _NP_DTYPES.get(i.type, np.float32) for i in self.session.get_inputs()}
        self.outputs = {o.name: _NP_DTYPES.get(o.type, np.float32) for o in self.session.get_outputs()}
        self.io_binding = io_binding
        self._buffers: dict[str, np.ndarray] = {}

    @property
    def input_names(self) -> list[str]:
        return list(self.inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self.outputs)

    def _buffer(self, name: str, shape: tuple) -> np.ndarray:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape:
            buf = np.empty(shape, dtype=self.outputs[name])
            self._buffers[name] = buf
        return buf

    def run(self, feeds: dict[str, np.ndarray], out_shapes: Optional[dict[str, tuple]] = None,
            outputs: Optional[Sequence[str]] = None, copy_outputs: bool = False) -> list[np.ndarray]:
        """Run the graph; return ``outputs`` (default: all, in graph order) as numpy arrays."""
        names = list(outputs) if outputs is not None else self.output_names
        feeds = {k: np.ascontiguousarray(v, dtype=self.inputs[k]) for k, v in feeds.items()}
        if not self.io_binding:
            return self.session.run(names, feeds)
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        preset = {}
        for name in names:
            shape = (out_shapes or {}).get(name)
            if shape is None:
                binding.bind_output(name, "cpu")
            else:
                buf = preset[name] = self._buffer(name, tuple(int(d) for d in shape))
                binding.bind_output(name, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
        self.session.run_with_iobinding(binding)
        out = []
        for name, value in zip(names, binding.get_outputs()):
            if name in preset:
                out.append(preset[name].copy() if copy_outputs else preset[name])
            else:
                out.append(value.numpy())
        return out
