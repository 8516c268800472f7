"""Registered voices whose prompt's cache the server holds, for the measurements that stream by voice id.

``register_prompt`` stores a prompt as given (no reference audio is embedded), so a repository's ``voice_encoder``
may run seeded random weights; ``held_voice`` registers an utterance's prompt and has both solver instances of the
cpu layout make its prompt pass (``s3flow.engine.voice_prompts``: each instance holds its own, and Triton hands
sequential streams to them in turn), so the streams measured after it solve no prompt frame::

    flags = voice_encoder_flags(tmp)                     # scripts/build_repository.py flags
    voice = held_voice(server.grpc_url, utterance)       # then voice.utterance(tokens, seed=...)
"""
from __future__ import annotations

from pathlib import Path

from s3flow.model.flow import FlowConfig
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow_client import StreamingClient, Utterance
from s3flow_client.voices import Voice, register_prompt

#: short streams that make a voice's prompt pass: one per solver instance of the cpu layout
WARM_STREAMS = 2


def voice_encoder_flags(folder: Path, cache_mb: int = 64) -> list[str]:
    """Build flags for a ``voice_encoder`` on seeded random weights (written into ``folder``) and ``cache_mb`` of
    voices' prompt caches per solver instance."""
    ckpt = write_random_checkpoint(Path(folder) / "voice.safetensors", FlowConfig.small(), seed=0)
    return ["--voice", "--voice-checkpoint", str(ckpt), "--voice-cache-mb", str(cache_mb)]


def held_voice(url: str, u: Utterance, model: str = "token2mel") -> Voice:
    """``u``'s prompt registered on the server at ``url``, its prompt pass made on every solver instance."""
    voice = register_prompt(url, u.prompt_tokens, u.prompt_mel, u.speaker_embedding)
    for _ in range(WARM_STREAMS):
        StreamingClient(url, model).synthesize([voice.utterance(u.speech_tokens[:10])])
    return voice
