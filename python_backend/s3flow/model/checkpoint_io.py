"""Any module's tensors in an S3Gen checkpoint file: read by name prefix, written with string metadata, compared.

An S3Gen checkpoint holds several modules side by side under top-level prefixes (``flow.``, ``mel2wav.``,
``tokenizer.``, ``speaker_encoder.``); each module's loader (``s3flow.model.checkpoint`` for the flow,
``s3flow.model.vocoder``, ``s3flow.model.voice.weights``) reads its own prefix through these functions. Files we write
record each module's sizes as a string in the file's metadata. ``.pt`` files are read with
``torch.load(weights_only=True)``: no pickled code runs.

Example::

    state, meta = read_tensors("s3gen.safetensors", "mel2wav.")
    save_tensors(state, "/tmp/hift.safetensors", meta)
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class CheckpointMismatch(ValueError):
    """The checkpoint's keys or shapes do not match the model; the message lists the differences."""


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
