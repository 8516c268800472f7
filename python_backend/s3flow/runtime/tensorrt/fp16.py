"""The fp16 copy of an exported graph that a strongly typed fp16 engine is built from.

Every tensor is fp16 except the islands that must not be, which stay fp32 with casts around them -
LayerNormalization, Softmax, L2 norms, the sinusoidal time embedding and its MLP (``t * 1000`` through
``sin``/``cos`` loses whole radians in fp16), and the meanflow time mixer. Constants beyond the fp16
range are clamped to +-:data:`FP16_SAFE_LIMIT`: the estimator's attention mask bias is ``-1e10``,
which is ``-inf`` in fp16, and ``(1 - mask) * -inf`` is NaN on every *valid* frame (0 * inf).
Strong typing is the only mode TensorRT 11 has (precision flags were deprecated in 10.12 and removed in
11; this does by hand what ModelOpt AutoCast does), and it makes the fp32 islands a property of the
graph rather than of builder hints.

``onnx`` is imported only inside :func:`convert_to_fp16`: the policy and the clamp are plain Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

#: Largest magnitude a constant keeps in the fp16 graph (fp16 max is 65504; headroom for adds).
FP16_SAFE_LIMIT = 3.0e4
#: ONNX ops computed in fp32 in an fp16 engine.
FP32_OPS = frozenset({"LayerNormalization", "Softmax", "ReduceL2", "ReduceSumSquare", "ReduceMean", "Sqrt"})
#: Node-name scopes (torch module paths in the export) computed in fp32 in an fp16 engine.
FP32_SCOPES = ("/time_embeddings/", "/time_mlp/", "/time_embed_mixer", "/spk_embed_affine_layer/")


def is_fp32_node(name: str, op_type: str) -> bool:
    """Whether an ONNX node stays fp32 in an fp16 engine (see the module docstring)."""
    return op_type in FP32_OPS or any(scope in name for scope in FP32_SCOPES)


def clamp_for_fp16(values: np.ndarray, limit: float = FP16_SAFE_LIMIT) -> np.ndarray:
    """Finite values beyond +-limit clamped to +-limit (infinities are kept: fp16 has them)."""
    out = np.array(values, dtype=np.float32, copy=True)
    big = np.isfinite(out) & (np.abs(out) > limit)
    out[big] = np.sign(out[big]) * limit
    return out


@dataclass
class Fp16Report:
    """What :func:`convert_to_fp16` did: nodes kept fp32, casts added, constants clamped."""
    fp32_nodes: int = 0
    fp16_nodes: int = 0
    casts: int = 0
    clamped: list = field(default_factory=list)


def convert_to_fp16(model, keep_fp32: Callable[[str, str], bool] = is_fp32_node,
                    limit: float = FP16_SAFE_LIMIT):
    """An fp16 copy of an ONNX model with fp32 islands, fp32 inputs and outputs (for strong typing).

    Every float tensor is produced in the precision of the node producing it (graph inputs: fp32).
    A consumer that needs the other precision reads it through one Cast per (tensor, precision), so
    fp32 values feeding fp32 islands (``t`` into the time embedding) never pass through fp16.
    Initializers and Constant values are read in either precision without casts; their fp16 copies
    are clamped to +-limit.

    Returns:
        (onnx.ModelProto, Fp16Report)
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
    src = onnx.shape_inference.infer_shapes(model)
    g = src.graph
    for node in g.node:
        if node.op_type in ("If", "Loop", "Scan"):
            raise ValueError(f"convert_to_fp16 does not handle subgraphs ({node.op_type} {node.name})")
    types: dict[str, int] = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        types[vi.name] = vi.type.tensor_type.elem_type
    consts: dict[str, np.ndarray] = {}
    for init in g.initializer:
        types[init.name] = init.data_type
        if init.data_type == FLOAT:
            consts[init.name] = numpy_helper.to_array(init)
    for node in g.node:
        if node.op_type == "Constant":
            attr = {a.name: a for a in node.attribute}
            if "value" in attr:
                types[node.output[0]] = attr["value"].t.data_type
                if attr["value"].t.data_type == FLOAT:
                    consts[node.output[0]] = numpy_helper.to_array(attr["value"].t)
            elif "value_float" in attr or "value_floats" in attr:
                v = attr["value_float"].f if "value_float" in attr else list(attr["value_floats"].floats)
                types[node.output[0]] = FLOAT
                consts[node.output[0]] = np.asarray(v, dtype=np.float32)

    report = Fp16Report()
    produced: dict[str, int] = {i.name: 32 for i in g.input if types.get(i.name) == FLOAT}
    out_nodes, inits, memo = [], [], {}
    outputs = {o.name for o in g.output if types.get(o.name) == FLOAT}
    rename = {o: f"{o}__pre_fp32" for o in outputs}

    def is_float(name: str) -> bool:
        if not name:
            return False
        if name not in types:
            raise ValueError(f"convert_to_fp16: no type inferred for tensor {name!r}")
        return types[name] == FLOAT

    def get(name: str, want: int) -> str:
        """The name of a tensor holding ``name``'s value in precision ``want`` (32 or 16)."""
        if not is_float(name):
            return name
        key = (name, want)
        if key in memo:
            return memo[key]
        if name in consts:
            arr = consts[name]
            if want == 16:
                clamped = clamp_for_fp16(arr, limit)
                if not np.array_equal(clamped, arr.astype(np.float32), equal_nan=True):
                    report.clamped.append(name)
                out = f"{name}__fp16"
                with np.errstate(over="ignore"):  # beyond-range values become inf only if limit allows
                    inits.append(numpy_helper.from_array(clamped.astype(np.float16), out))
            else:
                out = f"{name}__fp32"
                inits.append(numpy_helper.from_array(arr.astype(np.float32), out))
            memo[key] = out
            return out
        src_name = rename.get(name, name)
        if produced[name] == want:
            return src_name
        out = f"{name}__fp{want}"
        out_nodes.append(helper.make_node("Cast", [src_name], [out], to=HALF if want == 16 else FLOAT,
                                          name=f"{out}__cast"))
        report.casts += 1
        memo[key] = out
        return out

    for node in g.node:
        op = node.op_type
        if op == "Constant" and node.output[0] in consts:
            continue  # served by get() as an initializer in either precision
        want = 32 if keep_fp32(node.name, op) else 16
        new = onnx.NodeProto()
        new.CopyFrom(node)
        if op in ("Shape", "Size"):  # reads shapes only: any precision will do
            name = node.input[0]
            if name in consts:
                new.input[0] = get(name, 32)
            elif is_float(name):
                new.input[0] = rename.get(name, name)
        elif op == "Cast":
            if is_float(node.input[0]):
                new.input[0] = get(node.input[0], produced.get(node.input[0], want))
            for a in new.attribute:
                if a.name == "to" and a.i == FLOAT and want == 16:
                    a.i = HALF
        else:
            for k, name in enumerate(node.input):
                new.input[k] = get(name, want)
            if op == "ConstantOfShape" and want == 16 and types.get(node.output[0]) == FLOAT:
                value = [a for a in new.attribute if a.name == "value"]
                v = numpy_helper.to_array(value[0].t) if value else np.zeros(1, np.float32)
                del new.attribute[:]
                new.attribute.append(helper.make_attribute(
                    "value", numpy_helper.from_array(clamp_for_fp16(v, limit).astype(np.float16))))
        for k, name in enumerate(node.output):
            if is_float(name):
                produced[name] = want
            if name in rename:
                new.output[k] = rename[name]
        if any(is_float(o) for o in node.output) or any(is_float(i) for i in node.input):
            if want == 32:
                report.fp32_nodes += 1
            else:
                report.fp16_nodes += 1
        out_nodes.append(new)

    for o in outputs:  # graph outputs stay fp32 under their own names
        out_nodes.append(helper.make_node("Identity", [get(o, 32)], [o], name=f"{o}__out"))

    keep_inits = [i for i in g.initializer if i.data_type != FLOAT]
    new_graph = helper.make_graph(out_nodes, g.name, list(g.input), list(g.output),
                                  initializer=keep_inits + inits)
    converted = helper.make_model(new_graph, opset_imports=list(src.opset_import),
                                  producer_name="s3flow.runtime.tensorrt.fp16.convert_to_fp16")
    converted.ir_version = src.ir_version
    return converted, report

