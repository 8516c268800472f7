"""Seeded random weights in the upstream S3Gen layout: the flow's, and whole checkpoints that tests and demos load.

The modules' own initialisers leave biases, norm affines and the meanflow mixer at fixed values, so a port that
dropped one would still match on fresh weights: :func:`perturb_parameters` gives each a seeded random value.
:func:`write_random_checkpoint` writes the flow's tensors and, on request, the voice front-end's
(``s3flow.model.voice.weights.random_voice_state``) and the vocoder's (``s3flow.model.vocoder.random_vocoder``)
for the same seed, each module's sizes in the file's metadata.

Example::

    from s3flow.model.checkpoint import load_flow
    from s3flow.model.flow import FlowConfig
    from s3flow.model.random_checkpoint import write_random_checkpoint
    write_random_checkpoint("/tmp/s3gen_random.safetensors", FlowConfig.small(), seed=0)
    flow = load_flow("/tmp/s3gen_random.safetensors")
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from s3flow.model.checkpoint import CONFIG_METADATA_KEY, flow_state_dict
from s3flow.model.checkpoint_io import save_tensors
from s3flow.model.flow import FlowConfig, S3Flow
from s3flow.model.vocoder import VOCODER_CONFIG_KEY, VocoderConfig, random_vocoder, vocoder_state_dict
from s3flow.model.voice.weights import VOICE_CONFIG_KEY, VoiceConfig, random_voice_state


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
        voice_config = VoiceConfig.full() if full else VoiceConfig.small()
        state.update(random_voice_state(voice_config, seed))
        metadata[VOICE_CONFIG_KEY] = json.dumps(voice_config.to_dict())
    if vocoder:
        hift = random_vocoder(VocoderConfig.full() if full else VocoderConfig.small(), seed)
        state.update({k: v.detach().contiguous().clone() for k, v in vocoder_state_dict(hift).items()})
        metadata[VOCODER_CONFIG_KEY] = json.dumps(hift.config.to_dict())
