"""Building engines: the toolchain (TensorRT's Python API or trtexec), the cache names, the build, the install.

A TensorRT plan is specific to the GPU model and the TensorRT version that built it, and to the ONNX file
and the optimisation profile it was built from. :func:`engine_name` folds all of these into the file
name, so a cache of engines (a volume shared by many pods) never hands a stale or foreign engine to a
server: a changed checkpoint, GPU, TensorRT or profile gives another name, and the engine is rebuilt.

Precision: ``fp32`` builds the ONNX export as it is, TF32 off (the parity reference of the other builds);
``fp16`` builds a strongly typed network from the fp16 copy of the graph (``s3flow.runtime.tensorrt.fp16``).

Example (on a GPU host; see scripts/build_engines.py for the command line)::

    prof = estimator_profile(n_feats=80, meanflow=False, max_batch=8, max_frames=4000)
    res = build_engine("repo/estimator/model.onnx", "engines/", prof, "fp16")
    res.path  # engines/estimator__NVIDIA-H200-sm90__trt10.13.3__fp16__b1-2-16_t2-300-4000__src1a2b3c4d5e6f.plan

``tensorrt`` and ``onnx`` are imported only where an engine is built: naming and commands are plain Python.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from s3flow.runtime.tensorrt.fp16 import convert_to_fp16
from s3flow.runtime.tensorrt.profiles import MODELS, Profile

PRECISIONS = ("fp32", "fp16")


class EngineBuildError(RuntimeError):
    """Building, loading or checking an engine failed; the message says which and why."""


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
