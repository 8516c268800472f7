"""Checkpoints in the upstream S3Gen layout (``flow.*`` keys), real or seeded random.

A user's ``s3gen.safetensors`` / ``s3gen.pt`` loads with no renaming: the encoder side lives under
``flow.`` (``flow.input_embedding``, ``flow.encoder.*``, ``flow.encoder_proj``, ``flow.spk_embed_affine_layer``)
and the estimator under ``flow.decoder.estimator.``. Other top-level modules of an S3Gen checkpoint
(``mel2wav.*``, ``speaker_encoder.*``, ``tokenizer.*``) are read by ``s3flow.model.vocoder`` and ``s3flow.model.voice``.
``.pt`` files are read with ``torch.load(weights_only=True)``: no pickled code runs.

Example::

    from s3flow.model.checkpoint import write_random_checkpoint, load_flow
    write_random_checkpoint("/tmp/s3gen_random.safetensors", FlowConfig.small(), seed=0)
    flow = load_flow("/tmp/s3gen_random.safetensors")
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from s3flow.model.flow import FlowConfig, S3Flow

FLOW_PREFIX = "flow."
ESTIMATOR_PREFIX = "flow.decoder.estimator."
MIXER_KEY = ESTIMATOR_PREFIX + "time_embed_mixer.weight"
#: safetensors metadata key holding our FlowConfig (absent from upstream checkpoints: they are full size).
CONFIG_METADATA_KEY = "s3flow_config"


class CheckpointMismatch(ValueError):
    """The checkpoint's keys or shapes do not match the model; the message lists the differences."""


def flow_state_dict(flow: S3Flow) -> dict[str, torch.Tensor]:
    """The module's parameters under their upstream checkpoint names."""
    out = {FLOW_PREFIX + k: v for k, v in flow.encoder.state_dict().items()}
    out.update({ESTIMATOR_PREFIX + k: v for k, v in flow.estimator.state_dict().items()})
    return out


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], Optional[FlowConfig]]:
    """The ``flow.*`` tensors of a checkpoint and its recorded FlowConfig (None for upstream files)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    config = None
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys() if k.startswith(FLOW_PREFIX)}
        if CONFIG_METADATA_KEY in meta:
            config = FlowConfig.from_dict(json.loads(meta[CONFIG_METADATA_KEY]))
    elif path.suffix in (".pt", ".pth", ".bin"):
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
        if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
            obj = obj["state_dict"]
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: expected a state dict, got {type(obj).__name__}")
        state = {k: v for k, v in obj.items() if k.startswith(FLOW_PREFIX)}
        if isinstance(obj.get(CONFIG_METADATA_KEY), str):
            config = FlowConfig.from_dict(json.loads(obj[CONFIG_METADATA_KEY]))
    else:
        raise ValueError(f"{path}: unsupported checkpoint type {path.suffix!r} (use .safetensors or .pt)")
    if not state:
        raise CheckpointMismatch(f"{path}: no 'flow.*' tensors found; is this an S3Gen checkpoint?")
    return state, config


def is_meanflow(state: dict[str, torch.Tensor]) -> bool:
    """A distilled meanflow (Turbo) checkpoint carries the estimator's time mixer."""
    return MIXER_KEY in state


def load_state_into(flow: S3Flow, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Strict load; on any difference raise CheckpointMismatch listing missing, unexpected, mis-shaped."""
    expected = flow_state_dict(flow)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
                       for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or misshaped:
        def listing(title, items):
            shown = "\n  ".join(items[:20]) + (f"\n  ... and {len(items) - 20} more" if len(items) > 20 else "")
            return f"{title} ({len(items)}):\n  {shown}" if items else ""
        parts = [listing("missing keys", missing), listing("unexpected keys", unexpected),
                 listing("shape mismatches", misshaped)]
        raise CheckpointMismatch(f"{source} does not match the model:\n" + "\n".join(p for p in parts if p))
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


@torch.no_grad()
def perturb_parameters(flow: S3Flow, seed: int, scale: float = 0.1) -> None:
    """Randomise every parameter the modules' own initialisers leave at a fixed value.

    The reference initialisers set every bias to 0, every LayerNorm to (1, 0) and the meanflow mixer to
    [I | 0], so a port that dropped biases, norm affines or the r path would still match on fresh
    weights. Here biases and norm shifts get N(0, scale^2), norm scales 1 + N(0, scale^2), and the mixer
    [I | 0] + N(0, (scale / 4)^2), so a dropped parameter changes the output.
    """
    gen = torch.Generator().manual_seed(seed)
    for module_name, module in flow.named_modules():
        for name, p in module.named_parameters(recurse=False):
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)) and name == "weight":
                p.copy_(1.0 + scale * noise)
            elif name == "bias":
                p.copy_(scale * noise)
            elif module_name.endswith("time_embed_mixer"):
                p.add_(0.25 * scale * noise)


def random_flow(config: FlowConfig, seed: int = 0) -> S3Flow:
    """A seeded random S3Flow with every parameter perturbed (see ``perturb_parameters``)."""
    torch.manual_seed(seed)
    flow = S3Flow(config)
    perturb_parameters(flow, seed + 1)
    return flow.eval()


def write_checkpoint(flow: S3Flow, path: str | Path) -> Path:
    """Save in the upstream layout (``.safetensors`` with our config in its metadata, or ``.pt``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in flow_state_dict(flow).items()}
    config = json.dumps(flow.config.to_dict())
    if path.suffix == ".safetensors":
        save_file(state, str(path), metadata={CONFIG_METADATA_KEY: config})
    elif path.suffix in (".pt", ".pth"):
        torch.save({**state, CONFIG_METADATA_KEY: config}, str(path))
    else:
        raise ValueError(f"{path}: unsupported checkpoint type {path.suffix!r} (use .safetensors or .pt)")
    return path


def write_random_checkpoint(path: str | Path, config: FlowConfig, seed: int = 0, voice: bool = True,
                            vocoder: bool = False) -> Path:
    """Write a seeded random checkpoint in the exact upstream layout (what tests and demos load).

    ``flow.*`` always (the same tensors for a given config and seed whatever the flags); with ``voice`` also the
    front-end's ``tokenizer.*`` and ``speaker_encoder.*`` (``s3flow.model.voice``; full size for the full flow
    config, ``VoiceConfig.small()`` otherwise); with ``vocoder`` also ``mel2wav.*``, the tensors
    ``write_random_vocoder_checkpoint`` writes for the same seed (full or ``VocoderConfig.small()`` likewise).
    The sizes of each part are recorded in the file's metadata.
    """
    flow = random_flow(config, seed)
    state = {k: v.detach().contiguous().clone() for k, v in flow_state_dict(flow).items()}
    metadata = {CONFIG_METADATA_KEY: json.dumps(flow.config.to_dict())}
    full = config.to_dict() == FlowConfig.full(config.meanflow).to_dict()
    with torch.random.fork_rng(devices=[]):    # the global RNG is left as random_flow leaves it, as before
        _add_random_modules(state, metadata, full, seed, voice, vocoder)
    return save_tensors(state, path, metadata)


def _add_random_modules(state: dict, metadata: dict, full: bool, seed: int, voice: bool, vocoder: bool) -> None:
    if voice:
        from s3flow.model.voice.weights import VOICE_CONFIG_KEY, VoiceConfig, random_voice_state
        voice_config = VoiceConfig.full() if full else VoiceConfig.small()
        state.update(random_voice_state(voice_config, seed))
        metadata[VOICE_CONFIG_KEY] = json.dumps(voice_config.to_dict())
    if vocoder:
        from s3flow.model.vocoder import VOCODER_CONFIG_KEY, VocoderConfig, random_vocoder, vocoder_state_dict
        hift = random_vocoder(VocoderConfig.full() if full else VocoderConfig.small(), seed)
        state.update({k: v.detach().contiguous().clone() for k, v in vocoder_state_dict(hift).items()})
        metadata[VOCODER_CONFIG_KEY] = json.dumps(hift.config.to_dict())


# -- any module's tensors (the vocoder's ``mel2wav.*`` use these) -------------------------------------


def read_tensors(path: str | Path, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a checkpoint whose names start with ``prefix`` (kept whole), and the file's string
    metadata (safetensors metadata, or the string entries of a ``.pt`` dict)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            state = {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    elif path.suffix in (".pt", ".pth", ".bin"):
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
        if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
            obj = obj["state_dict"]
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: expected a state dict, got {type(obj).__name__}")
        state = {k: v for k, v in obj.items() if k.startswith(prefix) and isinstance(v, torch.Tensor)}
        meta = {k: v for k, v in obj.items() if isinstance(v, str)}
    else:
        raise ValueError(f"{path}: unsupported checkpoint type {path.suffix!r} (use .safetensors or .pt)")
    if not state:
        raise CheckpointMismatch(f"{path}: no '{prefix}*' tensors found; is this an S3Gen checkpoint?")
    return state, meta


def describe_mismatch(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str:
    """Missing, unexpected and mis-shaped keys of ``state`` against ``expected`` ('' when they match)."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
                       for k in set(state) & set(expected) if state[k].shape != expected[k].shape)

    def listing(title, items):
        shown = "\n  ".join(items[:20]) + (f"\n  ... and {len(items) - 20} more" if len(items) > 20 else "")
        return f"{title} ({len(items)}):\n  {shown}" if items else ""
    parts = [listing("missing keys", missing), listing("unexpected keys", unexpected),
             listing("shape mismatches", misshaped)]
    return "\n".join(p for p in parts if p)


def save_tensors(state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> Path:
    """Write tensors (``.safetensors`` with string metadata, or ``.pt`` with the metadata as entries)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        save_file(state, str(path), metadata=metadata)
    elif path.suffix in (".pt", ".pth"):
        torch.save({**state, **metadata}, str(path))
    else:
        raise ValueError(f"{path}: unsupported checkpoint type {path.suffix!r} (use .safetensors or .pt)")
    return path
