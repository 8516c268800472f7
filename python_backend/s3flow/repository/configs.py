"""The ``config.pbtxt`` of every generated model, as a ``ModelConfig`` built from the tensor contract.

One function per model, each taking the mel bins, the meanflow flag where it matters and the
:class:`~s3flow.repository.settings.RepositorySettings`; the tensors come from ``s3flow_contract.tensors``,
the protobuf builders from ``s3flow.repository.model_config``. Nothing here writes a file
(``s3flow.repository.generator`` does).

Example::

    from s3flow.repository.model_config import to_text
    from s3flow.repository.configs import solver_config
    from s3flow.repository.settings import RepositorySettings
    print(to_text(solver_config(80, False, RepositorySettings())))
"""
from __future__ import annotations

import dataclasses

from s3flow_contract.tensors import (ADMISSION_OUTPUTS, ADMITTED, ADMITTED_AUDIO, ENCODER_MODEL, ESTIMATOR_MODEL,
                                     REQUEST, SOLVER_INPUTS, SOLVER_OUTPUTS, SOLVER_TO_VOCODER, STREAM_RESPONSE,
                                     VOCODER_INPUTS, VOCODER_OUTPUTS, VOICE_ENCODER_INPUTS, VOICE_ENCODER_OUTPUTS,
                                     Tensor, stateless_tensors)
from s3flow.repository.model_config import (ModelConfig, add_ensemble_step, add_instances, add_sequence_controls,
                                         add_tensors, set_parameters, set_strategy)
from s3flow.repository.settings import RepositorySettings

PYTHON = "python"


def _python(name: str, max_batch_size: int) -> ModelConfig:
    return ModelConfig(name=name, backend=PYTHON, max_batch_size=max_batch_size)


def _fields(settings) -> dict:
    """A settings dataclass's fields as ``parameters`` entries."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}


def solver_config(n_feats: int, meanflow: bool, s: RepositorySettings, cache_shape=None) -> ModelConfig:
    """``cfm_solver``: sequence batching with the four controls, the request in, the mel out, every limit
    and knob a parameter (``cache_shape``: the estimator's ``CacheShape`` where the solver keeps what streams
    solved, ``estimator_cache``)."""
    b, v = s.batching, s.voices
    config = _python("cfm_solver", b.max_batch_size)
    seq = add_sequence_controls(config, s.triton_idle_us(s.solver.sequences.idle_timeout_s))
    set_strategy(seq, b.strategy, b.max_queue_delay_us, b.max_candidate_sequences, b.preferred_batch_sizes)
    add_tensors(config, SOLVER_INPUTS, SOLVER_OUTPUTS, n_feats=n_feats)
    # on GPU hosts the solver runs on the device its BLS tensors live on
    add_instances(config, b.solver_instances, gpu=s.target == "gpu")
    set_parameters(config, {"n_feats": n_feats, "meanflow": meanflow, "encoder_model": ENCODER_MODEL,
                            "scheduling": s.scheduling,
                            "estimator_model": ESTIMATOR_MODEL, "torch_threads": s.torch_threads,
                            "length_bucket_ratio": b.length_bucket_ratio, "warmup": s.warmup, **s.solver.parameters(),
                            "voices": v.enabled, "voice_dir": v.voice_dir, "max_voices": v.max_voices,
                            "max_voice_bytes": v.max_voice_bytes})
    if s.keeps_solved:
        if cache_shape is None:
            raise ValueError("keep_solved needs the estimator's cache shape (s3flow.model.prefix_cache.CacheShape)")
        set_parameters(config, {"estimator_cache": cache_shape.parameter(), "estimator_plain": s.graphs_by_call})
    return config


def admission_config(n_feats: int, s: RepositorySettings) -> ModelConfig:
    """``admission``: the ensembles' first step (``s3flow.serving.admission``): stateless, the request in,
    ``admitted`` out; the request rules, the voice registry and the admission target as parameters."""
    v = s.voices
    config = _python("admission", s.batching.max_batch_size)
    add_tensors(config, REQUEST, ADMISSION_OUTPUTS, n_feats=n_feats)
    add_instances(config, s.batching.admission_instances, gpu=False)
    if s.batching.admission_batching:   # the requests queued while it was busy, in one execute (no delay)
        config.dynamic_batching.SetInParent()
    set_parameters(config, {"n_feats": n_feats, **dataclasses.asdict(s.solver.rules),
                            **dataclasses.asdict(s.solver.admission), "voices": v.enabled,
                            "voice_dir": v.voice_dir, "max_voices": v.max_voices,
                            "max_voice_bytes": v.max_voice_bytes})
    return config


def ensemble_config(n_feats: int, s: RepositorySettings) -> ModelConfig:
    """``token2mel``: the public request to ``admission``, then (admitted) to ``cfm_solver``; its mel (and the
    stream's snapshot) back."""
    config = ModelConfig(name="token2mel", platform="ensemble", max_batch_size=s.batching.max_batch_size)
    add_tensors(config, REQUEST, STREAM_RESPONSE, n_feats=n_feats)
    _solver_steps(config, s)
    return config


def _solver_steps(config: ModelConfig, s: RepositorySettings, outputs=STREAM_RESPONSE, write_to=None,
                  admitted: Tensor = ADMITTED) -> None:
    """admission (unless ``s.admission`` is off), then cfm_solver waiting for its answer; ``outputs``: the
    solver outputs the ensemble maps, ``write_to``: to internal tensors of these names (``add_ensemble_step``);
    ``admitted``: the admission output the ensemble asks for (``ADMISSION_OUTPUTS``: it tells admission what the
    START will cost), fed to the solver's ``admitted``."""
    if s.admission:
        add_ensemble_step(config, "admission", REQUEST, (admitted,), write_to={admitted.name: ADMITTED.name})
        add_ensemble_step(config, "cfm_solver", SOLVER_INPUTS, outputs, write_to=write_to)
    else:
        add_ensemble_step(config, "cfm_solver", REQUEST, outputs, write_to=write_to)


def wav_ensemble_config(n_feats: int, s: RepositorySettings) -> ModelConfig:
    """``token2wav``: token2mel's steps; cfm_solver's mel feeds the vocoder (as internal tensors,
    ``SOLVER_TO_VOCODER``), which makes every output: the audio, and the mel passed on. Each output is thus made
    by the last step only, and a request that names any subset of them runs every step (an ensemble prunes the
    steps that make no output it was asked for)."""
    config = ModelConfig(name="token2wav", platform="ensemble", max_batch_size=s.batching.max_batch_size)
    add_tensors(config, REQUEST, VOCODER_OUTPUTS, n_feats=n_feats)
    _solver_steps(config, s, SOLVER_OUTPUTS, write_to=SOLVER_TO_VOCODER, admitted=ADMITTED_AUDIO)
    add_ensemble_step(config, "vocoder", VOCODER_INPUTS, VOCODER_OUTPUTS, read_from=SOLVER_TO_VOCODER)
    return config


#: the estimator's plain and read-only graphs beside its cached one (``RepositorySettings.graphs_by_call``),
#: in its version folder
PLAIN_GRAPH, READ_GRAPH = "plain.onnx", "read.onnx"


def stateless_config(name: str, n_feats: int, meanflow: bool, settings: RepositorySettings,
                     instances: int) -> ModelConfig:
    """``flow_encoder`` or ``estimator`` (``max_batch_size: 0``: the solver sends whole batches) as served on
    ``settings.target``: cpu: ONNX Runtime in a python model; gpu: a ``tensorrt_plan`` (built on the serving
    GPU by scripts/build_engines.py), or with ``gpu_backend="torch"`` torch on CUDA in a python model
    (``s3flow.serving.triton_models.torch_model``). ``meanflow`` matters to the estimator only."""
    inputs, outputs = stateless_tensors(name, meanflow, cached=settings.keeps_solved)
    s = settings
    if s.target == "gpu" and s.gpu_backend == "torch":
        from s3flow.runtime.torch_runner import default_dtype
        config = _python(name, 0)
        params = {"dtype": default_dtype(name, s.torch_dtype), "FORCE_CPU_ONLY_INPUT_TENSORS": "no"}
    elif s.target == "gpu":
        config, params = ModelConfig(name=name, platform="tensorrt_plan", max_batch_size=0), {}
    else:
        config, params = _python(name, 0), {"intra_op_threads": s.ort_threads}
        if name == ENCODER_MODEL:
            params["allow_spinning"] = s.encoder_spinning
    add_tensors(config, inputs, outputs, n_feats=n_feats)
    add_instances(config, instances, gpu=s.target == "gpu")
    if name == ESTIMATOR_MODEL and s.graphs_by_call:
        params.update(plain_graph=PLAIN_GRAPH, read_graph=READ_GRAPH)
    set_parameters(config, params)
    return config


def vocoder_config(n_feats: int, s: RepositorySettings, stream, source) -> ModelConfig:
    """The stateful ``vocoder``: the solver's sequence controls and limits (idle eviction, live cap),
    ``stream``: its ``StreamSettings``, no queue delay; ``source``: the HiFT's ``SourceParams``."""
    from s3flow.runtime.vocoder_runner import vocoder_backend_for

    backend = vocoder_backend_for(s.target, s.vocoder_backend)   # torch on the gpu target: HiFT on the GPU
    config = _python("vocoder", s.batching.max_batch_size)
    limits = s.solver.sequences
    seq = add_sequence_controls(config, s.triton_idle_us(limits.idle_timeout_s))
    set_strategy(seq, "oldest", 0, s.batching.max_candidate_sequences)
    add_tensors(config, VOCODER_INPUTS, VOCODER_OUTPUTS, n_feats=n_feats)
    add_instances(config, 1, gpu=backend == "torch" and s.target == "gpu")
    set_parameters(config, {"n_feats": n_feats, "vocoder_backend": backend, "intra_op_threads": s.ort_threads,
                            "allow_spinning": s.vocoder_spinning, "warmup": s.warmup,
                            **_fields(stream), **_fields(limits), **_fields(source)})
    return config


def voice_encoder_config(n_feats: int, s: RepositorySettings) -> ModelConfig:
    """``voice_encoder``: a reference wav (or a ready prompt) in, its voice id and prompt out (no batching:
    one reference per request; s3flow.serving.voice_service)."""
    v = s.voices
    config = _python("voice_encoder", 0)
    add_tensors(config, VOICE_ENCODER_INPUTS, VOICE_ENCODER_OUTPUTS, n_feats=n_feats)
    add_instances(config, 1, gpu=False)
    set_parameters(config, {"n_feats": n_feats, "max_prompt_tokens": s.solver.rules.max_prompt_tokens,
                            "voice_dir": v.voice_dir, "max_voices": v.max_voices,
                            "max_voice_bytes": v.max_voice_bytes, "torch_threads": s.torch_threads})
    return config
