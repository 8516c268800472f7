"""Model configs as data: ``ModelConfig`` protobufs built from the tensor contract, written and read with
protobuf's ``text_format``; one writer of model folders (Triton-free: unit-tested without a server). Typed
parameters and the load-time contract check, which the python models use, are in
``s3flow.serving.config_params`` (no protobuf import).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from s3flow_contract.tensors import CONTROLS, Tensor

ModelConfig = mc.ModelConfig
PathLike = Union[str, Path]
CONFIG_FILE = "config.pbtxt"

_CONTROL_KINDS = {"START": mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START,
                  "END": mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_END,
                  "READY": mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_READY,
                  "CORRID": mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID}


def add_tensors(config: ModelConfig, inputs: Iterable[Tensor] = (), outputs: Iterable[Tensor] = (), *,
                n_feats: int) -> ModelConfig:
    """Declare the contract's tensors as the config's inputs and outputs (``FEATS`` resolved)."""
    for t in inputs:
        config.input.add(name=t.name, data_type=mc.DataType.Value(t.config_type), dims=t.shape(n_feats),
                         optional=t.optional, allow_ragged_batch=t.ragged)
    for t in outputs:
        config.output.add(name=t.name, data_type=mc.DataType.Value(t.config_type), dims=t.shape(n_feats))
    return config


def set_parameters(config: ModelConfig, params: Mapping[str, object]) -> ModelConfig:
    """``parameters`` entries; booleans are spelled ``true``/``false`` (what ``config_params.Params`` reads)."""
    for key, value in params.items():
        config.parameters[key].string_value = str(value).lower() if isinstance(value, bool) else str(value)
    return config


def add_sequence_controls(config: ModelConfig, idle_us: int) -> mc.ModelSequenceBatching:
    """Sequence batching with the four controls the stateful models read (``contract.CONTROLS``)."""
    seq = config.sequence_batching
    seq.max_sequence_idle_microseconds = idle_us
    for name in CONTROLS:
        control = seq.control_input.add(name=name).control.add(kind=_CONTROL_KINDS[name])
        if name == "CORRID":
            control.data_type = mc.TYPE_UINT64
        else:
            control.int32_false_true.extend([0, 1])
    return seq


def set_strategy(seq: mc.ModelSequenceBatching, strategy: str, max_queue_delay_us: int,
                 max_candidate_sequences: int = 0, preferred_batch_sizes: Iterable[int] = ()) -> None:
    """The sequence batcher's scheduling: ``oldest`` (batches chunks of up to ``max_candidate_sequences``
    sequences) or ``direct`` (one slot per sequence)."""
    if strategy == "oldest":
        seq.oldest.SetInParent()
        seq.oldest.max_candidate_sequences = max_candidate_sequences
        seq.oldest.max_queue_delay_microseconds = max_queue_delay_us
        seq.oldest.preferred_batch_size.extend(preferred_batch_sizes)
    elif strategy == "direct":
        seq.direct.SetInParent()
        seq.direct.max_queue_delay_microseconds = max_queue_delay_us
    else:
        raise ValueError(f"strategy must be 'oldest' or 'direct', got {strategy!r}")


def add_ensemble_step(config: ModelConfig, model: str, inputs: Iterable[Tensor], outputs: Iterable[Tensor],
                      read_from: Optional[Mapping[str, str]] = None,
                      write_to: Optional[Mapping[str, str]] = None) -> mc.ModelEnsembling.Step:
    """A step of an ensemble that calls ``model`` (its latest version) with the ensemble's tensors of the same
    names: ``inputs`` are read from the ensemble's inputs or an earlier step's outputs. ``read_from`` /
    ``write_to`` map a model input / output name to another ensemble tensor (an internal one)."""
    read_from, write_to = read_from or {}, write_to or {}
    step = config.ensemble_scheduling.step.add(model_name=model, model_version=-1)
    step.input_map.update({t.name: read_from.get(t.name, t.name) for t in inputs})
    step.output_map.update({t.name: write_to.get(t.name, t.name) for t in outputs})
    return step


def check_ensemble(config: ModelConfig) -> None:
    """Raise ValueError unless every step reads a tensor the ensemble has by then (an input or an earlier
    step's output), every ensemble output is some step's output, and no ensemble output is also a step's input:
    Triton prunes the steps that make no output a request names, so a step that made an output and another
    step's input would be cut away from (or cut away) a request naming a subset of the outputs."""
    have = {i.name for i in config.input}
    outputs = {o.name for o in config.output}
    for k, step in enumerate(config.ensemble_scheduling.step):
        missing = sorted(set(step.input_map.values()) - have)
        if missing:
            raise ValueError(f"{config.name}: step {k} ({step.model_name}) reads {missing}, which no input or "
                             f"earlier step provides")
        shared = sorted(set(step.input_map.values()) & outputs)
        if shared:
            raise ValueError(f"{config.name}: step {k} ({step.model_name}) reads the ensemble outputs {shared}: a "
                             f"request naming a subset of the outputs would prune a step it needs")
        have |= set(step.output_map.values())
    missing = sorted(outputs - have)
    if missing:
        raise ValueError(f"{config.name}: outputs {missing} are made by no step")


def add_instances(config: ModelConfig, count: int, gpu: bool) -> ModelConfig:
    config.instance_group.add(count=count, kind=mc.ModelInstanceGroup.KIND_GPU if gpu else
                              mc.ModelInstanceGroup.KIND_CPU)
    return config


def to_text(config: ModelConfig) -> str:
    return text_format.MessageToString(config)


def read_config(path: PathLike) -> ModelConfig:
    """A ``config.pbtxt`` (or the model folder holding one) as a ModelConfig."""
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_FILE
    return text_format.Parse(path.read_text(), ModelConfig())


def write_config(folder: PathLike, config: ModelConfig) -> Path:
    path = Path(folder) / CONFIG_FILE
    path.write_text(to_text(config))
    return path


def write_model_folder(repository: PathLike, config: ModelConfig,
                       files: Optional[Mapping[str, Union[str, bytes]]] = None, *, replace: bool = True) -> list[Path]:
    """Write one model folder: ``<name>/config.pbtxt``, the version folder ``1/`` and ``files`` (relative path
    -> text or bytes, e.g. ``{"1/model.py": ...}``); with ``replace`` an old folder of that name goes first.
    Returns the config's path and the files' (a version folder left empty also gets a ``.keep``, not listed).
    An ensemble's steps are checked first (``check_ensemble``)."""
    if config.platform == "ensemble":
        check_ensemble(config)
    folder = Path(repository) / config.name
    if replace and folder.exists():
        shutil.rmtree(folder)
    (folder / "1").mkdir(parents=True, exist_ok=True)
    written = [write_config(folder, config)]
    for rel, text in (files or {}).items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            (folder / rel).write_bytes(text)
        else:
            (folder / rel).write_text(text)
        written.append(folder / rel)
    if not any((folder / "1").iterdir()):
        (folder / "1" / ".keep").write_text("")
    return written
