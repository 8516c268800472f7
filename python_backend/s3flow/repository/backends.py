"""Switching a generated gpu repository's stateless models (``estimator``, ``flow_encoder``) between a TensorRT
plan and torch on CUDA, and what the engines' profiles need from its ``cfm_solver`` config
(``scripts/build_engines.py`` drives both)."""
from __future__ import annotations

from pathlib import Path

from s3flow.model.checkpoint import load_flow
from s3flow.engine.settings import SolverSettings
from s3flow.runtime import tensorrt as tb
from s3flow.runtime.torch_runner import DEFAULT_ESTIMATOR_DTYPE, WEIGHTS_FILE, default_dtype, save_module
from s3flow.serving.config_params import Params
from s3flow.repository.model_config import read_config, write_model_folder
from s3flow.repository.generator import MODEL_PY
from s3flow.repository.configs import stateless_config
from s3flow.repository.settings import RepositorySettings
from s3flow.repository.warmup_samples import add_model_warmup

SOLVER = "cfm_solver"


def read_served_shapes(repository: Path) -> tb.ServedShapes:
    """What the engines' profiles need from the repository's ``cfm_solver`` config: batch size, longest
    prompt and utterance, mel bins, meanflow (read as a ModelConfig, parameters through ``Params``)."""
    folder = Path(repository) / SOLVER
    if not (folder / "config.pbtxt").is_file():
        raise FileNotFoundError(f"{folder / 'config.pbtxt'} not found: is {repository} a repository from "
                                "build_repository.py?")
    config = read_config(folder)
    params = Params(config)
    settings = SolverSettings.from_parameters(params.raw)
    return tb.ServedShapes(max_batch=config.max_batch_size, max_prompt_tokens=settings.rules.max_prompt_tokens,
                           max_utterance_frames=settings.solving.max_utterance_frames,
                           n_feats=params.int("n_feats"), meanflow=params.bool("meanflow"))


def set_backend(repository: Path, model: str, backend: str, checkpoint=None,
                dtype: str = DEFAULT_ESTIMATOR_DTYPE) -> str:
    """Rewrite one stateless model of a gpu repository to serve from a TensorRT plan or torch on CUDA: the
    config the generator writes for that backend (same instance count, warm-up kept), written by the one
    model-folder writer."""
    folder = repository / model
    current = read_config(folder)
    if backend == "tensorrt" and current.platform == "tensorrt_plan":
        return f"{model}: already served by TensorRT"
    st = read_served_shapes(repository)
    instances = current.instance_group[0].count if current.instance_group else 1
    settings = RepositorySettings(target="gpu", gpu_backend=backend, torch_dtype=dtype)
    config = stateless_config(model, st.n_feats, st.meanflow, settings, instances)
    # s3flow.serving.warmup's samples serve every backend: keep them where the repository has them
    files = add_model_warmup(config, st.n_feats, st.meanflow) if current.model_warmup else {}
    version = folder / "1"
    version.mkdir(exist_ok=True)
    if backend == "torch":
        if checkpoint is None:
            raise ValueError(f"the torch backend needs a checkpoint (the weights of the torch {model})")
        flow = load_flow(checkpoint)
        save_module(version / WEIGHTS_FILE, model, flow.estimator if model == "estimator" else flow.encoder)
        files["1/model.py"] = MODEL_PY["torch"]
        stale = ("model.plan", "engine.json")
    else:
        stale = ("model.py", WEIGHTS_FILE)
    for name in stale:
        (version / name).unlink(missing_ok=True)
    write_model_folder(repository, config, files, replace=False)
    return f"{model}: now served by " + (f"the torch backend ({default_dtype(model, dtype)})"
                                         if backend == "torch" else "TensorRT")
