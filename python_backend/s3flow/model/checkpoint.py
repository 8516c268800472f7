"""The flow's checkpoint in the upstream S3Gen layout (``flow.*`` keys): read, load, write.

A user's ``s3gen.safetensors`` / ``s3gen.pt`` loads with no renaming: the encoder side lives under
``flow.`` (``flow.input_embedding``, ``flow.encoder.*``, ``flow.encoder_proj``, ``flow.spk_embed_affine_layer``)
and the estimator under ``flow.decoder.estimator.``. Other top-level modules of an S3Gen checkpoint
(``mel2wav.*``, ``speaker_encoder.*``, ``tokenizer.*``) are read by ``s3flow.model.vocoder`` and ``s3flow.model.voice``;
any module's tensors are read and written by ``s3flow.model.checkpoint_io``, and seeded random checkpoints are
``s3flow.model.random_checkpoint``'s. ``.pt`` files are read with ``torch.load(weights_only=True)``: no pickled
code runs.

Example::

    from s3flow.model.checkpoint import load_flow, write_checkpoint
    flow = load_flow("s3gen.safetensors")           # config from the file's metadata, or the full-size one
    write_checkpoint(flow, "/tmp/s3gen_copy.safetensors")
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from s3flow.model.checkpoint_io import CheckpointMismatch, describe_mismatch, read_tensors, save_tensors
from s3flow.model.flow import FlowConfig, S3Flow

FLOW_PREFIX = "flow."
ESTIMATOR_PREFIX = "flow.decoder.estimator."
MIXER_KEY = ESTIMATOR_PREFIX + "time_embed_mixer.weight"
#: safetensors metadata key holding our FlowConfig (absent from upstream checkpoints: they are full size).
CONFIG_METADATA_KEY = "s3flow_config"


def flow_state_dict(flow: S3Flow) -> dict[str, torch.Tensor]:
    """The module's parameters under their upstream checkpoint names."""
    out = {FLOW_PREFIX + k: v for k, v in flow.encoder.state_dict().items()}
    out.update({ESTIMATOR_PREFIX + k: v for k, v in flow.estimator.state_dict().items()})
    return out


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], Optional[FlowConfig]]:
    """The ``flow.*`` tensors of a checkpoint and its recorded FlowConfig (None for upstream files)."""
    state, meta = read_tensors(path, FLOW_PREFIX)
    recorded = meta.get(CONFIG_METADATA_KEY)
    return state, (FlowConfig.from_dict(json.loads(recorded)) if recorded else None)


def is_meanflow(state: dict[str, torch.Tensor]) -> bool:
    """A distilled meanflow (Turbo) checkpoint carries the estimator's time mixer."""
    return MIXER_KEY in state


def load_state_into(flow: S3Flow, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Strict load; on any difference raise CheckpointMismatch listing missing, unexpected, mis-shaped."""
    message = describe_mismatch(flow_state_dict(flow), state)
    if message:
        raise CheckpointMismatch(f"{source} does not match the model:\n{message}")
    enc = {k[len(FLOW_PREFIX):]: v for k, v in state.items() if not k.startswith(ESTIMATOR_PREFIX)}
    est = {k[len(ESTIMATOR_PREFIX):]: v for k, v in state.items() if k.startswith(ESTIMATOR_PREFIX)}
    flow.encoder.load_state_dict(enc, strict=True)
    flow.estimator.load_state_dict(est, strict=True)


def load_flow(path: str | Path, config: Optional[FlowConfig] = None) -> S3Flow:
    """Build an S3Flow from a checkpoint. The config comes from (in order) the argument, the file's
    metadata, or the full-size upstream config with meanflow detected from the time mixer."""
    state, recorded = read_checkpoint(path)
    config = config or recorded or FlowConfig.full(meanflow=is_meanflow(state))
    flow = S3Flow(config)
    load_state_into(flow, state, source=str(path))
    return flow.eval()


def write_checkpoint(flow: S3Flow, path: str | Path) -> Path:
    """Save in the upstream layout (``.safetensors`` with our config in its metadata, or ``.pt``)."""
    state = {k: v.detach().contiguous().clone() for k, v in flow_state_dict(flow).items()}
    return save_tensors(state, path, {CONFIG_METADATA_KEY: json.dumps(flow.config.to_dict())})
