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
models with ``s3flow.serving.triton_models.torch_model`` (torch on CUDA, ``model.pt``) where no TensorRT
engine is built.

Each config is a ``ModelConfig`` (``s3flow.repository.configs``, from ``s3flow_contract.tensors``) written
with protobuf's ``text_format`` by ``s3flow.repository.model_config.write_model_folder``, the one writer of
model folders. Each python model's ``model.py`` is one line importing its class from ``s3flow.serving``, so
the server's Python environment must have this package installed (the README's set-up does it; the Docker
image too).

Example::

    from s3flow.model.checkpoint import load_flow
    from s3flow.repository.generator import RepositorySettings, write_repository
    print(write_repository("model_repository", load_flow("s3gen.safetensors"), RepositorySettings()).describe())
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from s3flow_contract.tensors import ENCODER_MODEL, ESTIMATOR_MODEL, STATELESS_MODELS
from s3flow.repository.model_config import ModelConfig, write_model_folder
from s3flow.repository.configs import (PLAIN_GRAPH, READ_GRAPH, admission_config, ensemble_config,
                                               solver_config, stateless_config, vocoder_config,
                                               voice_encoder_config, wav_ensemble_config)
from s3flow.repository.settings import RepositorySettings
from s3flow.repository.warmup_samples import add_model_warmup

MODEL_PY = {
    "admission": "from s3flow.serving.triton_models.admission_model import TritonPythonModel  # noqa: F401\n",
    "vocoder": "from s3flow.serving.triton_models.vocoder_model import TritonPythonModel  # noqa: F401\n",
    "cfm_solver": "from s3flow.serving.triton_models.cfm_solver import TritonPythonModel  # noqa: F401\n",
    "onnx": "from s3flow.serving.triton_models.onnx_model import TritonPythonModel  # noqa: F401\n",
    "torch": "from s3flow.serving.triton_models.torch_model import TritonPythonModel  # noqa: F401\n",
    "voice_encoder": "from s3flow.serving.triton_models.voice_encoder_model import TritonPythonModel  # noqa: F401\n",
}
#: The models that exist only with a vocoder / a voice checkpoint (removed when a build has none).
VOCODER_MODELS, VOICE_MODELS = ("token2wav", "vocoder"), ("voice_encoder",)
Files = dict[str, Union[str, bytes]]


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


def flow_models(n_feats: int, meanflow: bool, s: RepositorySettings,
                cache_shape=None) -> list[tuple[ModelConfig, Files]]:
    """token2mel, admission, cfm_solver, flow_encoder and estimator: each model's config (with its Triton
    warm-up sample where it has one, s3flow.serving.warmup) and the small files of its folder (model.py, the
    warm-up data); the weights are written beside them by :func:`write_repository`. ``cache_shape``: the
    estimator's (``CacheShape``), where the solver keeps what streams solved (``keep_solved``: the estimator serves
    the cached graph, and its warm-up sample is a first chunk's call)."""
    b = s.batching
    out = [(ensemble_config(n_feats, s), {})]
    if s.admission:
        out.append((admission_config(n_feats, s), {"1/model.py": MODEL_PY["admission"]}))
    solver = solver_config(n_feats, meanflow, s, cache_shape)
    solver_files: Files = {"1/model.py": MODEL_PY["cfm_solver"]}
    if s.warmup:  # one request that tells the solver its instance is set up (without it: the first real request)
        solver_files.update(add_model_warmup(solver, n_feats, meanflow))
    out.append((solver, solver_files))
    for name, instances in ((ENCODER_MODEL, b.encoder_instances), (ESTIMATOR_MODEL, b.estimator_instances)):
        config = stateless_config(name, n_feats, meanflow, s, instances)
        files: Files = {}
        if s.target == "cpu" or s.gpu_backend == "torch":
            files["1/model.py"] = MODEL_PY["onnx" if s.target == "cpu" else "torch"]
        if s.warmup:   # Triton's model_warmup samples: no first-run cost on a real request
            files.update(add_model_warmup(config, n_feats, meanflow,
                                          cache_shape if name == ESTIMATOR_MODEL else None, s.graphs_by_call))
        out.append((config, files))
    return out


def write_flow_configs(repository: Union[str, Path], n_feats: int, meanflow: bool,
                       s: RepositorySettings) -> list[Path]:
    """Write again the five flow models' configs (and small files) of an existing repository for settings
    ``s``, keeping the weights (``s3flow_tools.measure.batching``: one repository, a config per sweep point). The
    solver takes registered voices if the repository has a voice encoder. (Keeping what streams solved changes the
    estimator's graph, not only configs: ``write_repository``.)"""
    if s.keeps_solved:
        raise ValueError("keep_solved changes the estimator's graph: write the repository again (write_repository)")
    voices = (Path(repository) / VOICE_MODELS[0]).is_dir()
    s = dataclasses.replace(s, voices=dataclasses.replace(s.voices, enabled=voices))
    s.check()
    return [p for config, files in flow_models(n_feats, meanflow, s)
            for p in write_model_folder(repository, config, files, replace=False)]


def write_vocoder_models(out: Path, vocoder, n_feats: int, s: RepositorySettings, stream_settings=None,
                         opset: int = 17) -> list:
    """Write ``token2wav`` and ``vocoder`` (configs, model.py, and the weights: the two ONNX graphs for the
    onnx backend, ``hift.safetensors`` for the torch one); return the files.

    The vocoder's sequence limits (idle timeout, live-sequence cap) and utterance length cap follow the solver's (no
    cap with bounded context).
    """
    from s3flow.engine.vocoder_stream import SERVED_FIRST_LOOKAHEAD_FRAMES, StreamSettings
    from s3flow.model.vocoder import write_vocoder_checkpoint
    from s3flow.runtime.vocoder import export_vocoder
    from s3flow.runtime.vocoder_runner import VOCODER_WEIGHTS_FILE, vocoder_backend_for

    if vocoder.config.in_channels != n_feats:
        raise ValueError(f"the vocoder takes {vocoder.config.in_channels} mel bins, the flow makes {n_feats}")
    backend = vocoder_backend_for(s.target, s.vocoder_backend)   # a bad name fails before anything is written
    solving = s.solver.solving   # the solver's prefix mode caps an utterance; bounded context does not
    stream = dataclasses.replace(stream_settings or StreamSettings(first_lookahead_frames=SERVED_FIRST_LOOKAHEAD_FRAMES),
                                 max_utterance_frames=solving.max_utterance_frames if solving.context_frames < 0 else 0)
    stream.check()
    out = Path(out)
    files = write_model_folder(out, wav_ensemble_config(n_feats, s))
    config = vocoder_config(n_feats, s, stream, vocoder.config.source_params())
    files += write_model_folder(out, config, {"1/model.py": MODEL_PY["vocoder"]})
    version = out / config.name / "1"
    if backend == "torch":
        return files + [write_vocoder_checkpoint(vocoder, version / VOCODER_WEIGHTS_FILE)]
    return files + list(export_vocoder(vocoder, version, opset=opset))


def write_voice_encoder(out: Path, voice_checkpoint, n_feats: int, s: RepositorySettings) -> list:
    """Write ``voice_encoder`` (config, model.py, the front-end's weights from ``voice_checkpoint``)."""
    from safetensors.torch import save

    from s3flow.model.voice.weights import VOICE_CONFIG_KEY, VoiceConfig, read_voice_tensors

    state, config = read_voice_tensors(voice_checkpoint)
    config = config or VoiceConfig.full()
    weights = save({k: v.contiguous() for k, v in state.items()},
                   metadata={VOICE_CONFIG_KEY: json.dumps(config.to_dict())})
    return write_model_folder(out, voice_encoder_config(n_feats, s),
                              {"1/model.py": MODEL_PY["voice_encoder"], "1/voice.safetensors": weights})


def write_repository(out: str | Path, flow, settings: Optional[RepositorySettings] = None,
                     opset: int = 17, vocoder=None, vocoder_settings=None,
                     voice_checkpoint=None) -> RepositorySummary:
    """Write configs, model.py files and (cpu target) the ONNX exports of ``flow`` into ``out``.

    With ``vocoder`` (an ``s3flow.model.vocoder.HiFTGenerator``) also ``token2wav`` and ``vocoder``
    (``vocoder_settings``: an ``s3flow.engine.vocoder_stream.StreamSettings``; default: the first response
    carries audio (``SERVED_FIRST_LOOKAHEAD_FRAMES``), exact streaming from the second on).
    With ``voice_checkpoint`` (a checkpoint holding ``tokenizer.*`` and ``speaker_encoder.*``) also
    ``voice_encoder``, and START requests may name a registered voice (``voice_id``).

    For the gpu target the ``model.plan`` engines are built on the GPU host (scripts/build_engines.py);
    this writes their configs and the ONNX files the engines are built from (``<model>/model.onnx``).
    """
    from s3flow.model.prefix_cache import CacheShape
    from s3flow.runtime.onnx_export import export_encoder, export_estimator

    s = dataclasses.replace(settings or RepositorySettings())
    s.voices = dataclasses.replace(s.voices, enabled=voice_checkpoint is not None)
    s.check()
    out = Path(out)
    n_feats, meanflow = flow.config.n_feats, flow.config.meanflow
    summary = RepositorySummary(path=out, target=s.target, meanflow=meanflow, n_feats=n_feats)
    cache_shape = CacheShape.of(flow.estimator.config) if s.keeps_solved else None
    for config, files in flow_models(n_feats, meanflow, s, cache_shape):
        summary.files += write_model_folder(out, config, files)
    # ONNX files: the served models on cpu; the engines' source on gpu
    onnx_dir = "1" if s.target == "cpu" else "."
    modules = {ENCODER_MODEL: flow.encoder, ESTIMATOR_MODEL: flow.estimator}
    export_encoder(flow.encoder, out / ENCODER_MODEL / onnx_dir / "model.onnx", opset=opset)
    export_estimator(flow.estimator, out / ESTIMATOR_MODEL / onnx_dir / "model.onnx", opset=opset,
                     cached=s.keeps_solved)
    summary.files += [out / name / onnx_dir / "model.onnx" for name in STATELESS_MODELS]
    if s.graphs_by_call:   # for the calls that read no cache and keep nothing, and those that keep nothing
        summary.files += [export_estimator(flow.estimator, out / ESTIMATOR_MODEL / onnx_dir / PLAIN_GRAPH, opset=opset),
                          export_estimator(flow.estimator, out / ESTIMATOR_MODEL / onnx_dir / READ_GRAPH, opset=opset,
                                           cached=True, keeps=False)]
    if s.target == "gpu" and s.gpu_backend == "torch":
        from s3flow.runtime.torch_runner import WEIGHTS_FILE, save_module
        for name in STATELESS_MODELS:
            summary.files.append(save_module(out / name / "1" / WEIGHTS_FILE, name, modules[name]))
    # a model left from an earlier build would serve another checkpoint's vocoder or voices
    for present, names in ((vocoder is not None, VOCODER_MODELS), (voice_checkpoint is not None, VOICE_MODELS),
                           (s.admission, ("admission",))):
        for name in () if present else names:
            if (out / name).exists():
                shutil.rmtree(out / name)
    if vocoder is not None:
        summary.files += write_vocoder_models(out, vocoder, n_feats, s, vocoder_settings, opset=opset)
    if voice_checkpoint is not None:
        summary.files += write_voice_encoder(out, voice_checkpoint, n_feats, s)
    return summary
