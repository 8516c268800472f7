"""Generate the Triton model repository for a target (``cpu`` or ``gpu``).

Layout written (``config.pbtxt`` is the contract; the models check it in ``initialize``)::

    token2mel/     ensemble: the public entry point clients call
    cfm_solver/    python backend, sequence batching: per-utterance state + Euler loop, BLS to the two below
    flow_encoder/  stateless: tokens -> mu, mask, spks   (cpu: ONNX Runtime in python; gpu: tensorrt_plan)
    estimator/     stateless ConditionalDecoder          (cpu: ONNX Runtime in python; gpu: tensorrt_plan)

Given a vocoder (``write_repository(..., vocoder=hift)``) it also writes::

    token2wav/     ensemble: cfm_solver -> vocoder; outputs audio + sample_offset (and mel + frame_offset)
    vocoder/       python backend, sequence batching: per-utterance HiFT state (s3flow.engine.vocoder_stream);
                   cpu: f0.onnx and decoder.onnx in ONNX Runtime; gpu: torch on CUDA (hift.safetensors)

On the gpu target every instance group is ``KIND_GPU``; ``gpu_backend="torch"`` serves the two stateless
models with ``s3flow.serving.triton_models.torch_model`` (torch on CUDA, ``model.pt``) where no TensorRT engine is built.

Each python model's ``model.py`` is one line importing its class from ``s3flow.serving``, so the server's
Python environment must have this package installed (the README's set-up does it; the Docker image too).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from s3flow.protocol import INPUT_DTYPES, VOICE_ID, XVECTOR_DIM, Limits

Target = Literal["cpu", "gpu"]

#: Seconds Triton keeps an idle sequence after the solver has evicted its state.
TRITON_IDLE_GRACE_S = 5.0

TRITON_DTYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32"}


@dataclass
class Batching:
    """Server-side batching knobs of the solver (see the README's batching section)."""
    strategy: Literal["oldest", "direct"] = "oldest"
    max_batch_size: int = 8                 # chunks of different utterances in one execute
    preferred_batch_sizes: tuple = ()
    max_queue_delay_us: int = 2000          # how long a chunk may wait for others to join its batch
    #: oldest: sequences Triton lets into the batcher at once. More than the solver's max_live_sequences,
    #: so that a START beyond that reaches the solver and is refused at once ("retry in N s") rather than
    #: waiting silently in Triton's backlog; the headroom also holds refused STARTs and abandoned sequences
    #: until their slots are reclaimed (idle_timeout_s + 5 s).
    max_candidate_sequences: int = 256
    solver_instances: int = 1
    estimator_instances: int = 1
    encoder_instances: int = 1
    length_bucket_ratio: float = 0.0        # >= 1: split a batch where a prefix is > this x the shortest; 0: off

    def check(self) -> None:
        if self.strategy not in ("oldest", "direct"):
            raise ValueError(f"strategy must be 'oldest' or 'direct', got {self.strategy!r}")
        for name in ("max_batch_size", "max_candidate_sequences", "solver_instances", "estimator_instances",
                     "encoder_instances"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.length_bucket_ratio and self.length_bucket_ratio < 1:
            raise ValueError(f"length_bucket_ratio must be 0 (off) or >= 1, got {self.length_bucket_ratio}")
        if any(not 1 <= p <= self.max_batch_size for p in self.preferred_batch_sizes):
            raise ValueError(f"preferred_batch_sizes must lie in [1, {self.max_batch_size}], "
                             f"got {list(self.preferred_batch_sizes)}")


@dataclass
class VoiceSettings:
    """The voice registry (s3flow.serving.voice_registry): where voices live and how many may stay."""
    voice_dir: str = ""                     # "": a folder per server run (voices survive nothing)
    max_voices: int = 1000
    max_voice_bytes: int = 256 << 20
    enabled: bool = False                   # set by write_repository when it writes voice_encoder

    def check(self) -> None:
        if self.max_voices < 1 or self.max_voice_bytes < 1:
            raise ValueError(f"max_voices and max_voice_bytes must be >= 1, got {self.max_voices}, "
                             f"{self.max_voice_bytes}")


@dataclass
class RepositorySettings:
    target: Target = "cpu"
    limits: Limits = field(default_factory=Limits)
    batching: Batching = field(default_factory=Batching)
    ort_threads: int = 0                    # ONNX Runtime intra-op threads (0: all cores)
    torch_threads: int = 1                  # the solver's own torch work is small
    gpu_backend: Literal["tensorrt", "torch"] = "tensorrt"  # gpu target: TensorRT plans or torch on CUDA
    torch_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"   # gpu_backend torch: the estimator's compute dtype
    warmup: bool = True                     # warm every model up at load (s3flow.serving.warmup)
    vocoder_backend: Literal["auto", "onnx", "torch"] = "auto"  # auto: torch on the GPU (gpu), onnx (cpu)
    voices: VoiceSettings = field(default_factory=VoiceSettings)


def _param(key: str, value) -> str:
    return f'  {{ key: "{key}" value: {{ string_value: "{value}" }} }}'


def _tensor(name: str, dtype: str, dims: list, optional: bool = False, ragged: bool = False) -> str:
    extra = (" optional: true" if optional else "") + (" allow_ragged_batch: true" if ragged else "")
    return f'  {{ name: "{name}" data_type: {dtype} dims: {json.dumps(dims)}{extra} }}'


def _block(title: str, items: list[str]) -> str:
    return f"{title} [\n" + ",\n".join(items) + "\n]\n"


def _request_tensors(n_feats: int, optional_start: bool) -> list[str]:
    dims = {"speech_tokens": [-1], "prompt_tokens": [-1], "prompt_mel": [-1, n_feats],
            "speaker_embedding": [XVECTOR_DIM], "n_timesteps": [1], "guidance_rate": [1], "seed": [1]}
    tensors = [_tensor(name, TRITON_DTYPES[dtype.__name__], dims[name],
                       optional=optional_start and name != "speech_tokens", ragged=True)
               for name, dtype in INPUT_DTYPES.items()]
    # a START may name a registered voice instead of carrying the prompt (s3flow.serving.voice_registry)
    return tensors + [_tensor(VOICE_ID, "TYPE_STRING", [1], optional=True)] if optional_start else tensors


def _response_tensors(n_feats: int) -> list[str]:
    return [_tensor("mel", "TYPE_FP32", [n_feats, -1]), _tensor("frame_offset", "TYPE_INT64", [1])]


def solver_config(n_feats: int, meanflow: bool, s: RepositorySettings) -> str:
    b, lim = s.batching, s.limits
    # Triton forgets an idle sequence a little after the solver evicts it, so that a late chunk reaches the
    # solver and gets its clear "evicted after N s idle" error rather than Triton's "must specify START".
    idle_us = int((lim.idle_timeout_s + TRITON_IDLE_GRACE_S) * 1e6)
    if b.strategy == "oldest":
        pref = "".join(f" preferred_batch_size: {p}" for p in b.preferred_batch_sizes)
        strategy = (f"  oldest {{ max_candidate_sequences: {b.max_candidate_sequences}"
                    f" max_queue_delay_microseconds: {b.max_queue_delay_us}{pref} }}\n")
    else:
        strategy = f"  direct {{ max_queue_delay_microseconds: {b.max_queue_delay_us} }}\n"
    controls = (
        '  control_input [\n'
        '    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },\n'
        '    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },\n'
        '    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },\n'
        '    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }\n'
        '  ]\n')
    params = [_param("n_feats", n_feats), _param("meanflow", str(meanflow).lower()),
              _param("encoder_model", "flow_encoder"), _param("estimator_model", "estimator"),
              _param("torch_threads", s.torch_threads), _param("length_bucket_ratio", b.length_bucket_ratio),
              _param("warmup", str(s.warmup).lower())]
    params += [_param(f.name, getattr(lim, f.name)) for f in dataclasses.fields(lim)]
    v = s.voices
    params += [_param("voices", str(v.enabled).lower()), _param("voice_dir", v.voice_dir),
               _param("max_voices", v.max_voices), _param("max_voice_bytes", v.max_voice_bytes)]
    return (f'name: "cfm_solver"\nbackend: "python"\nmax_batch_size: {b.max_batch_size}\n'
            f"sequence_batching {{\n  max_sequence_idle_microseconds: {idle_us}\n{strategy}{controls}}}\n"
            + _block("input", _request_tensors(n_feats, optional_start=True))
            + _block("output", _response_tensors(n_feats))
            + f"instance_group [ {{ count: {b.solver_instances} kind: {_instance_kind(s)} }} ]\n"
            + _block("parameters", params))


def ensemble_config(n_feats: int, s: RepositorySettings) -> str:
    names = [*INPUT_DTYPES, VOICE_ID]
    maps_in = "\n".join(f'      input_map {{ key: "{n}" value: "{n}" }}' for n in names)
    maps_out = "\n".join(f'      output_map {{ key: "{n}" value: "{n}" }}' for n in ("mel", "frame_offset"))
    return (f'name: "token2mel"\nplatform: "ensemble"\nmax_batch_size: {s.batching.max_batch_size}\n'
            + _block("input", _request_tensors(n_feats, optional_start=True))
            + _block("output", _response_tensors(n_feats))
            + "ensemble_scheduling {\n  step [\n    {\n      model_name: \"cfm_solver\"\n      model_version: -1\n"
            + maps_in + "\n" + maps_out + "\n    }\n  ]\n}\n")


def estimator_tensors(n_feats: int, meanflow: bool) -> tuple[list[str], list[str]]:
    ins = [_tensor("x", "TYPE_FP32", [-1, n_feats, -1]), _tensor("mask", "TYPE_FP32", [-1, 1, -1]),
           _tensor("mu", "TYPE_FP32", [-1, n_feats, -1]), _tensor("t", "TYPE_FP32", [-1]),
           _tensor("spks", "TYPE_FP32", [-1, n_feats]), _tensor("cond", "TYPE_FP32", [-1, n_feats, -1])]
    if meanflow:
        ins.append(_tensor("r", "TYPE_FP32", [-1]))
    return ins, [_tensor("velocity", "TYPE_FP32", [-1, n_feats, -1])]


def encoder_tensors(n_feats: int) -> tuple[list[str], list[str]]:
    ins = [_tensor("tokens", "TYPE_INT64", [-1, -1]), _tensor("token_len", "TYPE_INT64", [-1]),
           _tensor("embedding", "TYPE_FP32", [-1, XVECTOR_DIM])]
    outs = [_tensor("mu", "TYPE_FP32", [-1, n_feats, -1]), _tensor("mask", "TYPE_FP32", [-1, 1, -1]),
            _tensor("spks", "TYPE_FP32", [-1, n_feats])]
    return ins, outs


def stateless_config(name: str, tensors: tuple[list[str], list[str]], s: RepositorySettings,
                     instances: int) -> str:
    ins, outs = tensors
    if s.target == "gpu" and s.gpu_backend == "torch":  # s3flow.serving.triton_models.torch_model on CUDA
        from s3flow.runtime.torch_runner import default_dtype
        head = f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        group = f"instance_group [ {{ count: {instances} kind: KIND_GPU }} ]\n"
        params = _block("parameters", [_param("dtype", default_dtype(name, s.torch_dtype)),
                                       _param("FORCE_CPU_ONLY_INPUT_TENSORS", "no")])
    elif s.target == "gpu":  # model.plan written by scripts/build_engines.py on the serving GPU
        head = f'name: "{name}"\nplatform: "tensorrt_plan"\nmax_batch_size: 0\n'
        group = f"instance_group [ {{ count: {instances} kind: KIND_GPU }} ]\n"
        params = ""
    else:
        head = f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        group = f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
        params = _block("parameters", [_param("intra_op_threads", s.ort_threads)])
    return head + _block("input", ins) + _block("output", outs) + group + params


SEQUENCE_CONTROLS = (
    '  control_input [\n'
    '    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },\n'
    '    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },\n'
    '    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },\n'
    '    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }\n'
    '  ]\n')


def vocoder_config(n_feats: int, s: RepositorySettings, stream, source) -> str:
    """The stateful ``vocoder``: same sequence controls and idle eviction as the solver, no queue delay."""
    b = s.batching
    strategy = (f"  oldest {{ max_candidate_sequences: {b.max_candidate_sequences}"
                f" max_queue_delay_microseconds: 0 }}\n")
    ins = [_tensor("mel", "TYPE_FP32", [n_feats, -1], ragged=True), _tensor("frame_offset", "TYPE_INT64", [1]),
           _tensor("seed", "TYPE_INT64", [1], optional=True)]
    outs = [_tensor("audio", "TYPE_FP32", [-1]), _tensor("sample_offset", "TYPE_INT64", [1])]
    from s3flow.model.vocoder import vocoder_backend_for
    backend = vocoder_backend_for(s.target, s.vocoder_backend)   # torch on the gpu target: HiFT on the GPU
    kind = "KIND_GPU" if backend == "torch" and s.target == "gpu" else "KIND_CPU"
    params = [_param("n_feats", n_feats), _param("vocoder_backend", backend),
              _param("intra_op_threads", s.ort_threads), _param("warmup", str(s.warmup).lower())]
    params += [_param(f.name, getattr(stream, f.name)) for f in dataclasses.fields(stream)]
    params += [_param(f.name, getattr(source, f.name)) for f in dataclasses.fields(source)]
    return (f'name: "vocoder"\nbackend: "python"\nmax_batch_size: {b.max_batch_size}\n'
            f"sequence_batching {{\n  max_sequence_idle_microseconds: {int(stream.idle_timeout_s * 1e6)}\n"
            f"{strategy}{SEQUENCE_CONTROLS}}}\n"
            + _block("input", ins) + _block("output", outs)
            + f"instance_group [ {{ count: 1 kind: {kind} }} ]\n" + _block("parameters", params))


def wav_ensemble_config(n_feats: int, s: RepositorySettings) -> str:
    """``token2wav``: token2mel's inputs; cfm_solver's mel feeds the vocoder; both steps' outputs out."""
    maps_in = "\n".join(f'      input_map {{ key: "{n}" value: "{n}" }}' for n in (*INPUT_DTYPES, VOICE_ID))
    solver_out = "\n".join(f'      output_map {{ key: "{n}" value: "{n}" }}' for n in ("mel", "frame_offset"))
    voc_in = "\n".join(f'      input_map {{ key: "{n}" value: "{n}" }}' for n in ("mel", "frame_offset", "seed"))
    voc_out = "\n".join(f'      output_map {{ key: "{n}" value: "{n}" }}' for n in ("audio", "sample_offset"))
    outs = [_tensor("audio", "TYPE_FP32", [-1]), _tensor("sample_offset", "TYPE_INT64", [1])]
    return (f'name: "token2wav"\nplatform: "ensemble"\nmax_batch_size: {s.batching.max_batch_size}\n'
            + _block("input", _request_tensors(n_feats, optional_start=True))
            + _block("output", outs + _response_tensors(n_feats))
            + "ensemble_scheduling {\n  step [\n"
            + "    {\n      model_name: \"cfm_solver\"\n      model_version: -1\n" + maps_in + "\n" + solver_out
            + "\n    },\n    {\n      model_name: \"vocoder\"\n      model_version: -1\n" + voc_in + "\n" + voc_out
            + "\n    }\n  ]\n}\n")


def write_vocoder_models(out: Path, vocoder, n_feats: int, s: RepositorySettings, stream_settings=None,
                         opset: int = 17) -> list:
    """Write ``token2wav`` and ``vocoder`` (configs, model.py, and the weights: the two ONNX graphs for the
    onnx backend, ``hift.safetensors`` for the torch one); return the files.

    The vocoder's idle timeout, live-sequence cap and utterance length follow the solver's limits.
    """
    from s3flow.model.vocoder import VOCODER_WEIGHTS_FILE, export_vocoder, vocoder_backend_for, write_vocoder_checkpoint
    from s3flow.engine.vocoder_stream import StreamSettings

    if vocoder.config.in_channels != n_feats:
        raise ValueError(f"the vocoder takes {vocoder.config.in_channels} mel bins, the flow makes {n_feats}")
    backend = vocoder_backend_for(s.target, s.vocoder_backend)   # a bad name fails before anything is written
    stream = dataclasses.replace(stream_settings or StreamSettings(), idle_timeout_s=s.limits.idle_timeout_s,
                                 max_live_sequences=s.limits.max_live_sequences,
                                 max_utterance_frames=s.limits.max_utterance_frames)
    stream.check()
    for name in ("token2wav", "vocoder"):
        if (out / name).exists():
            shutil.rmtree(out / name)
        (out / name / "1").mkdir(parents=True)
    files = [out / "token2wav/config.pbtxt", out / "vocoder/config.pbtxt", out / "vocoder/1/model.py"]
    files[0].write_text(wav_ensemble_config(n_feats, s))
    files[1].write_text(vocoder_config(n_feats, s, stream, vocoder.config.source_params()))
    files[2].write_text(MODEL_PY["vocoder"])
    (out / "token2wav" / "1" / ".keep").write_text("")
    if backend == "torch":
        return files + [write_vocoder_checkpoint(vocoder, out / "vocoder" / "1" / VOCODER_WEIGHTS_FILE)]
    return files + list(export_vocoder(vocoder, out / "vocoder" / "1", opset=opset))


MODEL_PY = {
    "vocoder": "from s3flow.serving.triton_models.vocoder_model import TritonPythonModel  # noqa: F401\n",
    "cfm_solver": "from s3flow.serving.triton_models.cfm_solver import TritonPythonModel  # noqa: F401\n",
    "onnx": "from s3flow.serving.triton_models.onnx_model import TritonPythonModel  # noqa: F401\n",
    "torch": "from s3flow.serving.triton_models.torch_model import TritonPythonModel  # noqa: F401\n",
    "voice_encoder": "from s3flow.serving.triton_models.voice_encoder_model import TritonPythonModel  # noqa: F401\n",
}


def _instance_kind(s: RepositorySettings) -> str:
    """The solver's instance kind: on GPU hosts it runs on the device its BLS tensors live on."""
    return "KIND_GPU" if s.target == "gpu" else "KIND_CPU"


@dataclass
class RepositorySummary:
    path: Path
    target: str
    meanflow: bool
    n_feats: int
    files: list = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"model repository at {self.path} (target {self.target}, "
                 f"{'meanflow' if self.meanflow else 'regular, guided'}, n_feats {self.n_feats}):"]
        for f in self.files:
            p = Path(f)
            size = p.stat().st_size if p.exists() else 0
            lines.append(f"  {p.relative_to(self.path)}  ({size / 1e6:.1f} MB)" if size > 1e6 else
                         f"  {p.relative_to(self.path)}")
        return "\n".join(lines)


def voice_encoder_config(n_feats: int, s: RepositorySettings) -> str:
    """``voice_encoder``: a reference wav (or a ready prompt) in, its voice id and prompt out (no batching:
    one reference per request; s3flow.serving.voice_service)."""
    ins = [_tensor("wav", "TYPE_FP32", [-1], optional=True), _tensor("sample_rate", "TYPE_INT32", [1], optional=True),
           _tensor("prompt_tokens", "TYPE_INT64", [-1], optional=True),
           _tensor("prompt_mel", "TYPE_FP32", [-1, n_feats], optional=True),
           _tensor("speaker_embedding", "TYPE_FP32", [XVECTOR_DIM], optional=True),
           _tensor("list_voices", "TYPE_BOOL", [1], optional=True)]
    outs = [_tensor(VOICE_ID, "TYPE_STRING", [1]), _tensor("prompt_tokens", "TYPE_INT64", [-1]),
            _tensor("prompt_mel", "TYPE_FP32", [-1, n_feats]), _tensor("speaker_embedding", "TYPE_FP32", [XVECTOR_DIM]),
            _tensor("voice_ids", "TYPE_STRING", [-1])]
    v = s.voices
    params = [_param("n_feats", n_feats), _param("max_prompt_tokens", s.limits.max_prompt_tokens),
              _param("voice_dir", v.voice_dir), _param("max_voices", v.max_voices),
              _param("max_voice_bytes", v.max_voice_bytes), _param("torch_threads", s.torch_threads)]
    return ('name: "voice_encoder"\nbackend: "python"\nmax_batch_size: 0\n' + _block("input", ins)
            + _block("output", outs) + "instance_group [ { count: 1 kind: KIND_CPU } ]\n" + _block("parameters", params))


def write_voice_encoder(out: Path, voice_checkpoint, n_feats: int, s: RepositorySettings) -> list:
    """Write ``voice_encoder`` (config, model.py, the front-end's weights from ``voice_checkpoint``)."""
    from safetensors.torch import save_file

    from s3flow.model.voice.weights import VOICE_CONFIG_KEY, VoiceConfig, read_voice_tensors

    state, config = read_voice_tensors(voice_checkpoint)
    config = config or VoiceConfig.full()
    if (out / "voice_encoder").exists():
        shutil.rmtree(out / "voice_encoder")
    (out / "voice_encoder" / "1").mkdir(parents=True)
    files = [out / "voice_encoder/config.pbtxt", out / "voice_encoder/1/model.py",
             out / "voice_encoder/1/voice.safetensors"]
    files[0].write_text(voice_encoder_config(n_feats, s))
    files[1].write_text(MODEL_PY["voice_encoder"])
    save_file({k: v.contiguous() for k, v in state.items()}, str(files[2]),
              metadata={VOICE_CONFIG_KEY: json.dumps(config.to_dict())})
    return files


def write_repository(out: str | Path, flow, settings: Optional[RepositorySettings] = None,
                     opset: int = 17, vocoder=None, vocoder_settings=None,
                     voice_checkpoint=None) -> RepositorySummary:
    """Write configs, model.py files and (cpu target) the ONNX exports of ``flow`` into ``out``.

    With ``vocoder`` (an ``s3flow.model.vocoder.HiFTGenerator``) also ``token2wav`` and ``vocoder``
    (``vocoder_settings``: an ``s3flow.engine.vocoder_stream.StreamSettings``, default exact streaming).
    With ``voice_checkpoint`` (a checkpoint holding ``tokenizer.*`` and ``speaker_encoder.*``) also
    ``voice_encoder``, and START requests may name a registered voice (``voice_id``).

    For the gpu target the ``model.plan`` engines are built on the GPU host (scripts/build_engines.py);
    this writes their configs and the ONNX files the engines are built from (``<model>/model.onnx``).
    """
    from s3flow.runtime.onnx_export import export_encoder, export_estimator

    s = dataclasses.replace(settings or RepositorySettings())
    s.voices = dataclasses.replace(s.voices, enabled=voice_checkpoint is not None)
    s.limits.check()
    s.batching.check()
    s.voices.check()
    if s.batching.strategy == "oldest" and s.limits.max_live_sequences >= s.batching.max_candidate_sequences:
        raise ValueError(
            f"max_live_sequences ({s.limits.max_live_sequences}) must be below max_candidate_sequences "
            f"({s.batching.max_candidate_sequences}): Triton would queue the extra utterances silently instead "
            f"of the solver refusing them; raise max_candidate_sequences or lower max_live_sequences")
    if s.gpu_backend not in ("tensorrt", "torch"):
        raise ValueError(f"gpu_backend must be 'tensorrt' or 'torch', got {s.gpu_backend!r}")
    out = Path(out)
    n_feats, meanflow = flow.config.n_feats, flow.config.meanflow
    for name in ("token2mel", "cfm_solver", "flow_encoder", "estimator"):
        if (out / name).exists():
            shutil.rmtree(out / name)
        (out / name / "1").mkdir(parents=True)
    summary = RepositorySummary(path=out, target=s.target, meanflow=meanflow, n_feats=n_feats)

    def write(rel: str, text: str):
        (out / rel).write_text(text)
        summary.files.append(out / rel)

    write("token2mel/config.pbtxt", ensemble_config(n_feats, s))
    write("cfm_solver/config.pbtxt", solver_config(n_feats, meanflow, s))
    write("cfm_solver/1/model.py", MODEL_PY["cfm_solver"])
    write("flow_encoder/config.pbtxt", stateless_config("flow_encoder", encoder_tensors(n_feats), s,
                                                        s.batching.encoder_instances))
    write("estimator/config.pbtxt", stateless_config("estimator", estimator_tensors(n_feats, meanflow), s,
                                                     s.batching.estimator_instances))
    if s.warmup:  # Triton's model_warmup samples (s3flow.serving.warmup): no first-run cost on a real request
        from s3flow.serving.warmup import write_model_warmup
        summary.files += [f for f in write_model_warmup(out, n_feats, meanflow) if f not in summary.files]
    # ONNX files: the served models on cpu; the engines' source on gpu
    onnx_dir = "1" if s.target == "cpu" else "."
    export_encoder(flow.encoder, out / "flow_encoder" / onnx_dir / "model.onnx", opset=opset)
    export_estimator(flow.estimator, out / "estimator" / onnx_dir / "model.onnx", opset=opset)
    summary.files += [out / "flow_encoder" / onnx_dir / "model.onnx", out / "estimator" / onnx_dir / "model.onnx"]
    if s.target == "cpu":
        write("flow_encoder/1/model.py", MODEL_PY["onnx"])
        write("estimator/1/model.py", MODEL_PY["onnx"])
    elif s.gpu_backend == "torch":
        from s3flow.runtime.torch_runner import WEIGHTS_FILE, save_module
        for name, module in (("flow_encoder", flow.encoder), ("estimator", flow.estimator)):
            write(f"{name}/1/model.py", MODEL_PY["torch"])
            summary.files.append(save_module(out / name / "1" / WEIGHTS_FILE, name, module))
    (out / "token2mel" / "1" / ".keep").write_text("")
    if vocoder is not None:
        summary.files += write_vocoder_models(out, vocoder, n_feats, s, vocoder_settings, opset=opset)
    else:  # a token2wav left from an earlier build would serve another model's vocoder
        for name in ("token2wav", "vocoder"):
            if (out / name).exists():
                shutil.rmtree(out / name)
    if voice_checkpoint is not None:
        summary.files += write_voice_encoder(out, voice_checkpoint, n_feats, s)
    elif (out / "voice_encoder").exists():
        shutil.rmtree(out / "voice_encoder")
    return summary
