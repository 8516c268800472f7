"""ONNX -> TensorRT engines for the estimator and the flow encoder, built on the GPU that serves them.

One module per concern; everything public is importable from here (``from s3flow.runtime import
tensorrt as tb``):

* ``profiles``: the optimisation profiles (:func:`estimator_profile`, :func:`encoder_profile`, sized from a
  repository's :class:`ServedShapes` by :func:`profiles_for`);
* ``fp16``: the fp16 copy of a graph with fp32 islands and clamped constants (:func:`convert_to_fp16`);
* ``build``: the toolchain, cache names (:func:`engine_name`), :func:`build_engine`, :func:`install_engine`;
* ``engine``: :class:`TrtEngine` (torch CUDA tensors as buffers) and :class:`TrtEstimator`;
* ``parity``: :func:`compare` and the engine checks against the fp32 reference.

Nothing here imports ``tensorrt`` or ``onnx`` at module level: naming, profiles, the fp16 conversion's
policy and the parity arithmetic are plain Python, unit-tested on CPU hosts.
"""
from s3flow.runtime.tensorrt.build import (PRECISIONS, BuildResult, EngineBuildError, Toolchain, build_engine,
                                           engine_name, file_digest, find_toolchain, find_trtexec, gpu_identity,
                                           install_engine, installed_engine, parse_trtexec_version, prepare_onnx,
                                           tensorrt_version, trtexec_command, trtexec_version)
from s3flow.runtime.tensorrt.engine import TrtEngine, TrtEstimator
from s3flow.runtime.tensorrt.fp16 import (FP16_SAFE_LIMIT, FP32_OPS, FP32_SCOPES, Fp16Report, clamp_for_fp16,
                                          convert_to_fp16, is_fp32_node)
from s3flow.runtime.tensorrt.parity import (PARITY_BOUNDS, Parity, check_encoder_engine, check_engine,
                                            check_estimator_engine, compare, encoder_cases, estimator_cases,
                                            onnxruntime_engine, random_inputs, rel_l2)
from s3flow.runtime.tensorrt.profiles import (ENCODER_MAX_FRAMES, MODELS, TOKEN_MEL_RATIO, Profile, ServedShapes,
                                              encoder_profile, estimator_profile, max_frames, max_tokens,
                                              profiles_for)

__all__ = [
    "PRECISIONS", "BuildResult", "EngineBuildError", "Toolchain", "build_engine", "engine_name", "file_digest",
    "find_toolchain", "find_trtexec", "gpu_identity", "install_engine", "installed_engine",
    "parse_trtexec_version", "prepare_onnx", "tensorrt_version", "trtexec_command", "trtexec_version",
    "TrtEngine", "TrtEstimator",
    "FP16_SAFE_LIMIT", "FP32_OPS", "FP32_SCOPES", "Fp16Report", "clamp_for_fp16", "convert_to_fp16", "is_fp32_node",
    "PARITY_BOUNDS", "Parity", "check_encoder_engine", "check_engine", "check_estimator_engine", "compare",
    "encoder_cases", "estimator_cases", "onnxruntime_engine", "random_inputs", "rel_l2",
    "ENCODER_MAX_FRAMES", "MODELS", "TOKEN_MEL_RATIO", "Profile", "ServedShapes", "encoder_profile",
    "estimator_profile", "max_frames", "max_tokens", "profiles_for",
]
