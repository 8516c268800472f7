"""ONNX -> TensorRT engines for the estimator and the flow encoder, built on the GPU that serves them.

A TensorRT plan is specific to the GPU model and the TensorRT version that built it, and to the ONNX file
and the optimisation profile it was built from. :func:`engine_name` folds all of these into the file
name, so a cache of engines (a volume shared by many pods) never hands a stale or foreign engine to a
server: a changed checkpoint, GPU, TensorRT or profile gives another name, and the engine is rebuilt.

Precision:

* ``fp32``: the ONNX export as it is, TF32 off (the parity reference of the other builds).
* ``fp16``: a *strongly typed* network from an fp16 copy of the graph (:func:`convert_to_fp16`): every
  tensor is fp16 except the islands that must not be, which stay fp32 with casts around them -
  LayerNormalization, Softmax, L2 norms, the sinusoidal time embedding and its MLP (``t * 1000`` through
  ``sin``/``cos`` loses whole radians in fp16), and the meanflow time mixer. Constants beyond the fp16
  range are clamped to +-:data:`FP16_SAFE_LIMIT`: the estimator's attention mask bias is ``-1e10``,
  which is ``-inf`` in fp16, and ``(1 - mask) * -inf`` is NaN on every *valid* frame (0 * inf).
  Strong typing is the only mode TensorRT 11 has (precision flags were deprecated in 10.12 and removed in
  11; this does by hand what ModelOpt AutoCast does), and it makes the fp32 islands a property of the
  graph rather than of builder hints.

Profiles (dynamic axes; one optimisation profile per engine):

* estimator: batch 1 .. 2 x max batch (a guided batch of B utterances is one 2B call; a guidance rate of
  0 calls with B rows), frames 2 .. prompt + generated frames the server admits, opt at 2 x 300;
* flow encoder: batch 1 .. max batch, tokens 1 .. prompt + speech tokens admitted, opt at 150 tokens.

:func:`estimator_profile` / :func:`encoder_profile` derive them from the repository's limits.

Parity: :func:`compare` gives the relative L2 error over valid frames and NaN/inf; an engine passes when
it is finite and under :data:`PARITY_BOUNDS` of its precision against the fp32 reference (the torch
module, or ONNX Runtime on the fp32 ONNX).

Example (on a GPU host; see scripts/build_engines.py for the command line)::

    prof = estimator_profile(n_feats=80, meanflow=False, max_batch=8, max_frames=4000)
    res = build_engine("repo/estimator/model.onnx", "engines/", prof, "fp16")
    res.path  # engines/estimator__NVIDIA-H200-sm90__trt10.13.3__fp16__b1-2-16_t2-300-4000__src1a2b3c4d5e6f.plan

Nothing here imports ``tensorrt`` or ``onnx`` at module level: naming, profiles, the fp16 conversion's
policy and the parity arithmetic are plain Python, unit-tested on CPU hosts.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from s3flow.protocol import XVECTOR_DIM, Limits

#: Relative L2 error bound against the fp32 reference, per engine precision (estimator and encoder).
PARITY_BOUNDS = {"fp32": 1e-3, "fp16": 2e-2}
#: Largest magnitude a constant keeps in the fp16 graph (fp16 max is 65504; headroom for adds).
FP16_SAFE_LIMIT = 3.0e4
#: ONNX ops computed in fp32 in an fp16 engine.
FP32_OPS = frozenset({"LayerNormalization", "Softmax", "ReduceL2", "ReduceSumSquare", "ReduceMean", "Sqrt"})
#: Node-name scopes (torch module paths in the export) computed in fp32 in an fp16 engine.
FP32_SCOPES = ("/time_embeddings/", "/time_mlp/", "/time_embed_mixer", "/spk_embed_affine_layer/")
PRECISIONS = ("fp32", "fp16")
MODELS = ("estimator", "flow_encoder")
#: Frames per token and the encoder's relative-position table (EncoderConfig.pos_enc_max_len default).
TOKEN_MEL_RATIO = 2
ENCODER_MAX_FRAMES = 6144


class EngineBuildError(RuntimeError):
    """Building, loading or checking an engine failed; the message says which and why."""


# ---------------------------------------------------------------------------------------------------
# Profiles and names


@dataclass(frozen=True)
class Profile:
    """One optimisation profile: (min, opt, max) of the batch axis and of the length axis.

    ``model`` is ``estimator`` (length = mel frames T) or ``flow_encoder`` (length = tokens N).
    """
    model: str
    batch: tuple[int, int, int]
    length: tuple[int, int, int]
    n_feats: int = 80
    meanflow: bool = False

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        for axis in ("batch", "length"):
            lo, opt, hi = getattr(self, axis)
            if not 1 <= lo <= opt <= hi:
                raise ValueError(f"{self.model} profile {axis} needs 1 <= min <= opt <= max, got {(lo, opt, hi)}")
        if self.model == "flow_encoder" and TOKEN_MEL_RATIO * self.length[2] > ENCODER_MAX_FRAMES:
            raise ValueError(f"flow_encoder profile max tokens {self.length[2]} exceeds the encoder's "
                             f"positional table ({ENCODER_MAX_FRAMES // TOKEN_MEL_RATIO} tokens)")

    def input_dims(self) -> dict[str, tuple]:
        """Input name -> dims with "B" for the batch and "L" for the length axis."""
        f = self.n_feats
        if self.model == "estimator":
            dims = {"x": ("B", f, "L"), "mask": ("B", 1, "L"), "mu": ("B", f, "L"), "t": ("B",),
                    "spks": ("B", f), "cond": ("B", f, "L")}
            if self.meanflow:
                dims["r"] = ("B",)
            return dims
        return {"tokens": ("B", "L"), "token_len": ("B",), "embedding": ("B", XVECTOR_DIM)}

    def input_shapes(self) -> dict[str, tuple[tuple, tuple, tuple]]:
        """Input name -> (min shape, opt shape, max shape)."""
        out = {}
        for name, dims in self.input_dims().items():
            out[name] = tuple(tuple(self.batch[k] if d == "B" else self.length[k] if d == "L" else d
                                    for d in dims) for k in range(3))
        return out

    def covers(self, batch: int, length: int) -> bool:
        return self.batch[0] <= batch <= self.batch[2] and self.length[0] <= length <= self.length[2]

    def tag(self) -> str:
        """Compact text of the ranges, e.g. ``b1-2-16_t2-300-4000`` (``n`` for the encoder's tokens)."""
        axis = "t" if self.model == "estimator" else "n"
        return f"b{'-'.join(map(str, self.batch))}_{axis}{'-'.join(map(str, self.length))}"


def max_frames(limits: Limits) -> int:
    """Longest estimator input the server admits: prompt frames + generated frames."""
    return TOKEN_MEL_RATIO * limits.max_prompt_tokens + limits.max_utterance_frames


def max_tokens(limits: Limits) -> int:
    """Longest encoder input the server admits: prompt tokens + speech tokens."""
    return limits.max_prompt_tokens + limits.max_utterance_frames // TOKEN_MEL_RATIO


def estimator_profile(n_feats: int, meanflow: bool, max_batch: int, max_frames: int, *,
                      min_frames: int = TOKEN_MEL_RATIO, opt_frames: int = 300,
                      opt_batch: Optional[int] = None) -> Profile:
    """Batch 1 .. 2 x max_batch (guided calls are 2B; meanflow calls are B), opt at one guided utterance."""
    hi = max_batch if meanflow else 2 * max_batch
    opt = opt_batch or (1 if meanflow else 2)
    return Profile("estimator", (1, min(opt, hi), hi),
                   (min_frames, min(max(opt_frames, min_frames), max_frames), max_frames), n_feats, meanflow)


def encoder_profile(max_batch: int, max_tokens: int, *, min_tokens: int = 1, opt_tokens: int = 150,
                    n_feats: int = 80) -> Profile:
    return Profile("flow_encoder", (1, 1, max_batch),
                   (min_tokens, min(max(opt_tokens, min_tokens), max_tokens), max_tokens), n_feats)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-.") or "unknown"


def engine_name(model: str, *, gpu: str, compute_capability: tuple[int, int], trt_version: str,
                precision: str, profile: Profile, source_digest: str) -> str:
    """The cache file name of an engine: everything that makes a plan invalid elsewhere is in it.

    ``estimator__NVIDIA-H200-sm90__trt10.13.3__fp16__b1-2-16_t2-300-4000__src1a2b3c4d5e6f.plan``

    Args:
        model: ``estimator`` or ``flow_encoder``.
        gpu: the device name (``torch.cuda.get_device_name``); compute_capability: e.g. (9, 0).
        trt_version: TensorRT version that builds (and must load) the engine.
        precision: ``fp32`` or ``fp16``.
        profile: the optimisation profile; source_digest: :func:`file_digest` of the ONNX source.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not re.fullmatch(r"[0-9a-f]{8,64}", source_digest):
        raise ValueError(f"source_digest must be hex (file_digest), got {source_digest!r}")
    if not re.fullmatch(r"\d+(\.\d+)*", trt_version):
        raise ValueError(f"trt_version must look like 10.13.3, got {trt_version!r}")
    major, minor = compute_capability
    return (f"{model}__{_slug(gpu)}-sm{major}{minor}__trt{trt_version}__{precision}__{profile.tag()}"
            f"__src{source_digest[:12]}.plan")


def _tmp(path: Path) -> Path:
    """A private temporary name beside ``path`` (pods sharing an engine cache may build at once)."""
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def file_digest(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """sha256 of a file, hex (the ONNX source of an engine)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# What the repository asks for


@dataclass
class SolverSettings:
    """What build_engines needs from a generated repository's ``cfm_solver/config.pbtxt``."""
    max_batch: int
    limits: Limits
    n_feats: int
    meanflow: bool


_PARAM = re.compile(r'key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}')


def read_solver_settings(repository: str | os.PathLike) -> SolverSettings:
    """Parse the solver's config (written by ``s3flow.serving.repository``): batch size, limits, n_feats, meanflow."""
    path = Path(repository) / "cfm_solver" / "config.pbtxt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {repository} a repository from build_repository.py?")
    text = path.read_text()
    m = re.search(r"^max_batch_size:\s*(\d+)", text, re.M)
    params = dict(_PARAM.findall(text))
    if m is None or "n_feats" not in params or "meanflow" not in params:
        raise ValueError(f"{path}: no max_batch_size / n_feats / meanflow in the config")
    return SolverSettings(max_batch=int(m.group(1)), limits=Limits.from_parameters(params),
                          n_feats=int(params["n_feats"]), meanflow=params["meanflow"].lower() == "true")


def profiles_for(settings: SolverSettings) -> dict[str, Profile]:
    """The two profiles a repository needs (sized by its limits and batch size)."""
    return {"estimator": estimator_profile(settings.n_feats, settings.meanflow, settings.max_batch,
                                           max_frames(settings.limits)),
            "flow_encoder": encoder_profile(settings.max_batch, max_tokens(settings.limits),
                                            n_feats=settings.n_feats)}


# ---------------------------------------------------------------------------------------------------
# fp16 graph


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
                                  producer_name="s3flow.runtime.tensorrt.convert_to_fp16")
    converted.ir_version = src.ir_version
    return converted, report


def prepare_onnx(onnx_path: str | os.PathLike, precision: str, workdir: str | os.PathLike) -> Path:
    """The ONNX file an engine of ``precision`` is built from (fp16: a converted copy in ``workdir``)."""
    onnx_path = Path(onnx_path)
    if precision == "fp32":
        return onnx_path
    import onnx

    out = Path(workdir) / f"{onnx_path.parent.name}.{file_digest(onnx_path)[:12]}.fp16.onnx"
    if not out.exists():
        converted, _ = convert_to_fp16(onnx.load(str(onnx_path)))
        tmp = _tmp(out)
        onnx.save(converted, str(tmp))
        os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------------------------------
# Toolchain: TensorRT Python API or trtexec


def tensorrt_version() -> Optional[str]:
    """Version of the importable ``tensorrt`` package, None if there is none."""
    try:
        import tensorrt as trt
    except ImportError:
        return None
    return trt.__version__


def find_trtexec() -> Optional[str]:
    for candidate in (shutil.which("trtexec"), "/usr/src/tensorrt/bin/trtexec", "/opt/tensorrt/bin/trtexec"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def parse_trtexec_version(banner: str) -> Optional[str]:
    """``[TensorRT v101303]`` (major*10000 + minor*100 + patch) -> ``10.13.3``."""
    m = re.search(r"TensorRT v(\d+)", banner)
    if not m:
        return None
    v = int(m.group(1))
    return f"{v // 10000}.{(v // 100) % 100}.{v % 100}"


def trtexec_version(trtexec: str) -> Optional[str]:
    try:
        out = subprocess.run([trtexec, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_trtexec_version(out.stdout + out.stderr)


def _shape_arg(shapes: dict[str, tuple]) -> str:
    return ",".join(f"{name}:{'x'.join(map(str, shape))}" for name, shape in shapes.items())


def trtexec_command(trtexec: str, onnx_path: str | os.PathLike, engine_path: str | os.PathLike,
                    profile: Profile, precision: str, *, workspace_mb: int = 8192,
                    opt_level: int = 3, timing_cache: Optional[str] = None) -> list[str]:
    """The trtexec command building the same engine as :func:`build_engine` (strongly typed)."""
    shapes = profile.input_shapes()
    cmd = [trtexec, f"--onnx={onnx_path}", f"--saveEngine={engine_path}", "--stronglyTyped",
           f"--minShapes={_shape_arg({k: v[0] for k, v in shapes.items()})}",
           f"--optShapes={_shape_arg({k: v[1] for k, v in shapes.items()})}",
           f"--maxShapes={_shape_arg({k: v[2] for k, v in shapes.items()})}",
           f"--memPoolSize=workspace:{workspace_mb}M", f"--builderOptimizationLevel={opt_level}",
           "--skipInference"]
    if precision == "fp32":
        cmd.append("--noTF32")
    if timing_cache:
        cmd.append(f"--timingCacheFile={timing_cache}")
    return cmd


@dataclass
class Toolchain:
    """How engines get built here: ``python`` (tensorrt package) or ``trtexec``, and its version."""
    tool: str
    version: str
    trtexec: Optional[str] = None


def find_toolchain(prefer: str = "auto") -> Toolchain:
    """The TensorRT Python API if importable (else trtexec), or raise EngineBuildError saying so."""
    if prefer not in ("auto", "python", "trtexec"):
        raise ValueError(f"tool must be auto, python or trtexec, got {prefer!r}")
    if prefer in ("auto", "python"):
        v = tensorrt_version()
        if v is not None:
            return Toolchain("python", v)
        if prefer == "python":
            raise EngineBuildError("the tensorrt Python package is not importable")
    exe = find_trtexec()
    if exe is not None:
        v = trtexec_version(exe)
        if v is not None:
            return Toolchain("trtexec", v, exe)
    raise EngineBuildError("no TensorRT here: the tensorrt Python package is not importable and no trtexec "
                           "was found (PATH, /usr/src/tensorrt/bin); serve with --gpu-backend torch instead")


def gpu_identity(device: int = 0) -> tuple[str, tuple[int, int]]:
    """(device name, compute capability) of a CUDA device."""
    if not torch.cuda.is_available():
        raise EngineBuildError("no CUDA device: TensorRT engines are built on the GPU that serves them")
    return torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device))


def _build_python(onnx_path: Path, engine_path: Path, profile: Profile, precision: str, *,
                  workspace_mb: int, opt_level: int) -> None:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flag_enum = trt.NetworkDefinitionCreationFlag
    strongly = hasattr(flag_enum, "STRONGLY_TYPED")
    flags = 1 << int(flag_enum.STRONGLY_TYPED) if strongly else 0
    if int(trt.__version__.split(".")[0]) < 10 and hasattr(flag_enum, "EXPLICIT_BATCH"):
        flags |= 1 << int(flag_enum.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
    if hasattr(config, "builder_optimization_level"):
        config.builder_optimization_level = opt_level
    if precision == "fp32" and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    if precision == "fp16" and not strongly:
        config.set_flag(trt.BuilderFlag.FP16)  # old TensorRT: the fp16 graph's types guide it
    shapes = profile.input_shapes()
    names = [network.get_input(i).name for i in range(network.num_inputs)]
    if set(names) != set(shapes):
        raise EngineBuildError(f"{onnx_path}: network inputs {sorted(names)} != profile inputs {sorted(shapes)}")
    prof = builder.create_optimization_profile()
    for name in names:
        prof.set_shape(name, *shapes[name])
    config.add_optimization_profile(prof)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise EngineBuildError(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
    tmp = _tmp(engine_path)
    tmp.write_bytes(bytes(blob))
    os.replace(tmp, engine_path)


@dataclass
class BuildResult:
    path: Path
    name: str
    precision: str
    profile: Profile
    tool: str
    trt_version: str
    seconds: float
    cached: bool


def build_engine(onnx_path: str | os.PathLike, cache_dir: str | os.PathLike, profile: Profile,
                 precision: str, *, toolchain: Optional[Toolchain] = None, workspace_mb: int = 8192,
                 opt_level: int = 3, device: int = 0, rebuild: bool = False,
                 log: Callable[[str], None] = print) -> BuildResult:
    """Build (or find in ``cache_dir``) the engine of ``onnx_path`` for this GPU and TensorRT."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    onnx_path, cache_dir = Path(onnx_path), Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tc = toolchain or find_toolchain()
    gpu, cc = gpu_identity(device)
    name = engine_name(profile.model, gpu=gpu, compute_capability=cc, trt_version=tc.version,
                       precision=precision, profile=profile, source_digest=file_digest(onnx_path))
    path = cache_dir / name
    if path.exists() and not rebuild:
        return BuildResult(path, name, precision, profile, tc.tool, tc.version, 0.0, True)
    source = prepare_onnx(onnx_path, precision, cache_dir)
    log(f"building {name} with {tc.tool} (TensorRT {tc.version}) from {source} ...")
    t0 = time.perf_counter()
    if tc.tool == "python":
        _build_python(source, path, profile, precision, workspace_mb=workspace_mb, opt_level=opt_level)
    else:
        tmp = _tmp(path)
        cmd = trtexec_command(tc.trtexec, source, tmp, profile, precision,
                              workspace_mb=workspace_mb, opt_level=opt_level)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise EngineBuildError(f"trtexec failed ({run.returncode}): {(run.stdout + run.stderr)[-3000:]}")
        os.replace(tmp, path)
    seconds = time.perf_counter() - t0
    log(f"built {name} in {seconds:.0f} s ({path.stat().st_size / 1e6:.0f} MB)")
    return BuildResult(path, name, precision, profile, tc.tool, tc.version, seconds, False)


def install_engine(result: BuildResult, repository: str | os.PathLike, model: str,
                   parity: Optional[list] = None) -> Path:
    """Copy the engine to ``<repository>/<model>/1/model.plan`` (atomically) with ``engine.json`` beside it."""
    target_dir = Path(repository) / model / "1"
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / "model.plan"
    tmp = _tmp(target)
    shutil.copyfile(result.path, tmp)
    os.replace(tmp, target)
    meta = {"engine": result.name, "precision": result.precision, "profile": asdict(result.profile),
            "tool": result.tool, "tensorrt": result.trt_version,
            "parity": [asdict(p) for p in parity or []]}
    (target_dir / "engine.json").write_text(json.dumps(meta, indent=2))
    return target


def installed_engine(repository: str | os.PathLike, model: str) -> Optional[str]:
    """Name of the engine installed for ``model`` (from its engine.json), None if none is."""
    meta = Path(repository) / model / "1" / "engine.json"
    if not meta.is_file() or not (meta.parent / "model.plan").is_file():
        return None
    return json.loads(meta.read_text()).get("engine")


# ---------------------------------------------------------------------------------------------------
# Running an engine (torch CUDA tensors as buffers)


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
    """A TensorRT estimator engine as a solver estimator (fp32 velocity out)."""

    def __init__(self, engine: TrtEngine):
        self.engine = engine

    def __call__(self, x, mask, mu, t, spks, cond, r=None):
        feeds = dict(x=x, mask=mask, mu=mu, t=t, spks=spks, cond=cond)
        if r is not None:
            feeds["r"] = r
        return self.engine(**feeds)["velocity"].float()


# ---------------------------------------------------------------------------------------------------
# Parity


@dataclass
class Parity:
    """One comparison against the fp32 reference. rel_error: ||out - ref|| / ||ref|| over valid frames."""
    what: str
    rel_error: float
    max_abs: float
    finite: bool
    bound: float

    @property
    def ok(self) -> bool:
        return self.finite and self.rel_error <= self.bound

    def describe(self) -> str:
        state = "ok" if self.ok else ("FAIL: NaN/inf" if not self.finite else "FAIL: above bound")
        return (f"{self.what}: rel err {self.rel_error:.2e} (bound {self.bound:.0e}), "
                f"max abs {self.max_abs:.2e} [{state}]")


def compare(out: torch.Tensor, ref: torch.Tensor, bound: float, what: str = "",
            mask: Optional[torch.Tensor] = None) -> Parity:
    """Relative L2 error of ``out`` against ``ref`` (same shape), over ``mask`` (broadcast) if given.

    NaN or inf anywhere in ``out`` fails whatever the error.
    """
    out, ref = out.detach().float().cpu(), ref.detach().float().cpu()
    if out.shape != ref.shape:
        raise ValueError(f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    finite = bool(torch.isfinite(out).all())
    if mask is not None:
        m = mask.detach().float().cpu().expand_as(ref) > 0
        out, ref = out[m], ref[m]
    diff = torch.nan_to_num(out - ref, nan=float("inf"))
    denom = float(ref.norm()) or 1.0
    rel = float(diff.norm()) / denom if finite else float("inf")
    return Parity(what, rel, float(diff.abs().max()) if diff.numel() else 0.0, finite, bound)


def estimator_cases(profile: Profile) -> list[tuple[int, int]]:
    """(batch, frames) shapes a parity check runs: the opt point and an odd padded one, inside the profile."""
    b_lo, b_opt, b_hi = profile.batch
    t_lo, t_opt, t_hi = profile.length
    cases = [(b_opt, t_opt), (min(max(b_opt + 1, b_lo), b_hi), min(max(t_opt * 2 + 17, t_lo), t_hi))]
    return list(dict.fromkeys(cases))


def check_estimator_engine(engine, reference: Callable, profile: Profile, precision: str,
                           seed: int = 0) -> list[Parity]:
    """Engine vs the fp32 reference (``reference(**inputs) -> velocity``) on random padded inputs.

    ``engine(**inputs)`` returns a dict with ``velocity``. Inputs: x, mu, cond ~ N(0, 1); rows padded.
    """
    bound = PARITY_BOUNDS[precision]
    out = []
    for b, t in estimator_cases(profile):
        g = torch.Generator().manual_seed(seed + b * 10007 + t)
        lengths = torch.tensor([max(1, t - (i * t) // (2 * b)) for i in range(b)])
        f = profile.n_feats
        inputs = {"x": torch.randn(b, f, t, generator=g),
                  "mask": (torch.arange(t)[None] < lengths[:, None]).float()[:, None],
                  "mu": torch.randn(b, f, t, generator=g), "t": torch.rand(b, generator=g),
                  "spks": torch.randn(b, f, generator=g), "cond": torch.randn(b, f, t, generator=g)}
        if profile.meanflow:
            inputs["r"] = torch.rand(b, generator=g)
        ref = reference(**inputs)
        got = engine(**inputs)["velocity"]
        out.append(compare(got, ref, bound, f"estimator {precision} B={b} T={t}", mask=inputs["mask"]))
    return out


def check_encoder_engine(engine, reference: Callable, profile: Profile, precision: str,
                         seed: int = 0, vocab: int = 6561) -> list[Parity]:
    """Encoder engine vs the fp32 reference (``reference(**inputs) -> (mu, mask, spks)``)."""
    bound = PARITY_BOUNDS[precision]
    b_lo, b_opt, b_hi = profile.batch
    n_lo, n_opt, n_hi = profile.length
    out = []
    for b, n in dict.fromkeys([(b_opt, n_opt), (min(max(2, b_lo), b_hi), min(max(n_opt + 37, n_lo), n_hi))]):
        g = torch.Generator().manual_seed(seed + b * 7919 + n)
        lens = torch.tensor([max(n_lo, n - (i * n) // (2 * b)) for i in range(b)], dtype=torch.int64)
        inputs = {"tokens": torch.randint(0, vocab, (b, n), generator=g),
                  "token_len": lens, "embedding": torch.randn(b, XVECTOR_DIM, generator=g)}
        mu_ref, mask_ref, spks_ref = reference(**inputs)
        got = engine(**inputs)
        out.append(compare(got["mu"], mu_ref, bound, f"encoder mu {precision} B={b} N={n}", mask=mask_ref))
        out.append(compare(got["spks"], spks_ref, bound, f"encoder spks {precision} B={b}"))
    return out


def onnxruntime_reference(onnx_path: str | os.PathLike, outputs: Sequence[str]):
    """An fp32 reference from ONNX Runtime on CPU (when the torch checkpoint is not at hand)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def run(**inputs):
        feed = {k: v.detach().cpu().numpy() for k, v in inputs.items() if k in names}
        vals = [torch.from_numpy(v) for v in sess.run(list(outputs), feed)]
        return vals[0] if len(vals) == 1 else tuple(vals)
    return run
