"""ONNX Runtime (CPU) sessions for the exported estimator and encoder, as solver/engine callables.

The same code runs in process (benchmarks, tests) and inside the Triton python models
(``s3flow.serving.triton_models.onnx_model``): :func:`session_options` holds the session settings in one place, and
:class:`OrtModel` runs a session by tensor name. Inputs are shared with numpy/torch, not copied. With
``io_binding=True`` it binds them in place and, where the caller knows the output shapes, writes outputs
into buffers it keeps; on the CPU provider that measured no faster than plain ``run`` (the binding object
costs about what the output allocation saves: 4.73 vs 4.58 ms median at B = 2, T = 64, small config), so
it is off by default and kept for providers where copies cost more.

Example::

    from s3flow.engine.streaming import StreamingEngine
    from s3flow.runtime.ort import OrtEncoder, OrtEstimator
    estimator = OrtEstimator("model_repository/estimator/1/model.onnx", threads=2)
    encoder = OrtEncoder("model_repository/flow_encoder/1/model.onnx", threads=2)
    engine = StreamingEngine(encoder, estimator, n_feats=80, meanflow=estimator.meanflow)

Shapes as in ``s3flow.runtime.onnx_export`` (``export_estimator``, ``export_encoder``);
tensor names are the contract's (``s3flow_contract.tensors``).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import onnxruntime as ort
import torch

from s3flow_contract import tensors as contract
from s3flow.model.solver import EstimatorInputs

_NP_DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}


@dataclass
class OrtSettings:
    """Session settings (the Triton models read them from config parameters of the same names).

    threads: intra-op threads, 0 = ONNX Runtime's default (one per core).
    spinning: let idle intra-op threads spin for work. Lower latency for back-to-back calls; but a
        spinning pool steals the core from another model's pool on a small host, so the served encoder
        (called once per chunk, between estimator calls) turns it off.
    optimization: graph optimisation level: "all", "extended", "basic" or "disable".
    rewrite: apply :func:`rewrite_for_cpu` when the session is made (the file on disk is not changed):
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


# ---------------------------------------------------------------------------------------------------
# Load-time graph rewrites (CPU): the ONNX file on disk stays as exported (TensorRT builds from it)


@dataclass
class RewriteCounts:
    mish: int = 0              # Softplus -> Tanh -> Mul rewritten to the exp form
    attention: int = 0         # unfused attention subgraphs replaced by com.microsoft.MultiHeadAttention


def _const_value(graph_consts: dict, name: str):
    value = graph_consts.get(name)
    return None if value is None else np.asarray(value)


def rewrite_for_cpu(model, mish: bool = True, attention: bool = True):
    """Rewrite an exported estimator graph (an ``onnx.ModelProto``, changed in place) for ONNX Runtime's CPU
    provider; returns :class:`RewriteCounts`. Both rewrites compute the same function in fp32:

    * Mish ``x * tanh(softplus(x))`` as ``x * n / (n + 2)`` with ``n = u (u + 2)``, ``u = exp(min(x, 20))``
      (tanh(log(1 + u)) = ((1 + u)^2 - 1) / ((1 + u)^2 + 1); at x > 20 both are 1 in fp32). ONNX Runtime's
      Softplus is scalar code; the exp form runs 7x faster at (2, 300, 256) and is closer to the float64 value.
    * Attention ``softmax(q k^T * scale + bias) v`` with the head split/merge transposes as one
      ``com.microsoft.MultiHeadAttention`` node: inputs stay (B, T, H*D), the (B, 1, 1, T) key bias
      (0 on valid keys, -1e10 on padding, see ``s3flow.model.estimator.mask_to_attention_bias``) becomes the
      key padding mask ``bias == 0`` with the same -1e10 fill.
    """
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    counts, new_nodes, new_inits, dead = RewriteCounts(), [], [], set()
    kpm_nodes: dict[str, list] = {}

    def only_consumer(name, op):
        users = consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op else None

    def from_op(name, op):
        n = producer.get(name)
        return n if n is not None and n.op_type == op else None

    def perm(n):
        return next((list(a.ints) for a in n.attribute if a.name == "perm"), None)

    def add_const(name, value):
        new_inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    if mish:
        c20, c2 = add_const("s3flow_mish_20", np.float32(20.0)), add_const("s3flow_mish_2", np.float32(2.0))
        for sp in [n for n in graph.node if n.op_type == "Softplus"]:
            x = sp.input[0]
            th = only_consumer(sp.output[0], "Tanh")
            mul = th and only_consumer(th.output[0], "Mul")
            if mul is None or set(mul.input) != {x, th.output[0]}:
                continue
            k, out = counts.mish, mul.output[0]
            p = f"s3flow_mish{k}_"
            new_nodes.append((mul, [
                helper.make_node("Min", [x, c20], [p + "xc"]), helper.make_node("Exp", [p + "xc"], [p + "u"]),
                helper.make_node("Add", [p + "u", c2], [p + "u2"]), helper.make_node("Mul", [p + "u", p + "u2"], [p + "n"]),
                helper.make_node("Add", [p + "n", c2], [p + "d"]), helper.make_node("Div", [p + "n", p + "d"], [p + "r"]),
                helper.make_node("Mul", [x, p + "r"], [out])]))
            dead.update(id(n) for n in (sp, th, mul))
            counts.mish += 1

    if attention:
        masks: dict[str, str] = {}
        for sm in [n for n in graph.node if n.op_type == "Softmax"]:
            add = from_op(sm.input[0], "Add")
            if add is None:
                continue
            scaled = next((from_op(i, "Mul") for i in add.input if from_op(i, "Mul") is not None), None)
            if scaled is None:
                continue
            bias = next(i for i in add.input if i != scaled.output[0])
            qk = next((from_op(i, "MatMul") for i in scaled.input if from_op(i, "MatMul") is not None), None)
            scale = next((_const_value(consts, i) for i in scaled.input if i in consts), None)
            pv = only_consumer(sm.output[0], "MatMul")
            if qk is None or scale is None or scale.size != 1 or pv is None or pv.input[0] != sm.output[0]:
                continue
            qt, kt, vt = from_op(qk.input[0], "Transpose"), from_op(qk.input[1], "Transpose"), from_op(pv.input[1], "Transpose")
            ot = only_consumer(pv.output[0], "Transpose")
            merge = ot and only_consumer(ot.output[0], "Reshape")
            if None in (qt, kt, vt, merge) or (perm(qt), perm(kt), perm(vt), perm(ot)) != (
                    [0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3], [0, 2, 1, 3]):
                continue
            splits = [from_op(t.input[0], "Reshape") for t in (qt, kt, vt)]
            if None in splits:
                continue
            shape_src = from_op(splits[0].input[1], "Concat")
            heads = shape_src is not None and _const_value(consts, shape_src.input[2])
            if heads is None or heads is False or heads.size != 1:
                continue
            heads = int(heads.reshape(-1)[0])
            if bias not in masks:  # key padding mask from the additive key bias: valid where it is 0
                p = f"s3flow_kpm{len(masks)}_"
                axes = add_const(p + "axes", np.array([1, 2], dtype=np.int64))
                zero = add_const(p + "zero", np.float32(0.0))
                kpm_nodes[bias] = [helper.make_node("Squeeze", [bias, axes], [p + "sq"]),
                                   helper.make_node("Equal", [p + "sq", zero], [p + "eq"]),
                                   helper.make_node("Cast", [p + "eq"], [p + "kpm"], to=TensorProto.INT32)]
                masks[bias] = p + "kpm"
            q, k, v = (r.input[0] for r in splits)
            new_nodes.append((merge, [helper.make_node(
                "MultiHeadAttention", [q, k, v, "", masks[bias]], [merge.output[0]], domain="com.microsoft",
                num_heads=heads, scale=float(scale.reshape(-1)[0]), mask_filter_value=-1.0e10,
                name=f"s3flow_mha{counts.attention}")]))
            dead.update(id(n) for n in (add, scaled, qk, sm, pv, ot, merge, qt, kt, vt, *splits))
            counts.attention += 1

    if not counts.mish and not counts.attention:
        return counts
    # rebuild the node list in order: new nodes where the subgraph they replace ended (their inputs are
    # all defined by then), key padding masks right after their bias; then drop nodes nothing reads
    after = {id(anchor): nodes for anchor, nodes in new_nodes}
    defined_early = {i.name for i in graph.input} | set(consts)
    rebuilt = [n for b, nodes in kpm_nodes.items() if b in defined_early for n in nodes]
    for n in graph.node:
        if id(n) not in dead:
            rebuilt.append(n)
            for o in n.output:
                rebuilt.extend(kpm_nodes.get(o, []))
        rebuilt.extend(after.get(id(n), []))
    outputs = {o.name for o in graph.output}
    while True:
        used = {i for n in rebuilt for i in n.input} | outputs
        keep = [n for n in rebuilt if any(o in used for o in n.output)]
        if len(keep) == len(rebuilt):
            break
        rebuilt = keep
    del graph.node[:]
    graph.node.extend(rebuilt)
    graph.initializer.extend(new_inits)
    if counts.attention and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return counts
