"""Voices: register a reference recording once, then start utterances by its voice id.

The server's ``voice_encoder`` model computes the speaker prompt of a reference (upstream ``embed_ref``:
tokens, 24 kHz mel, x-vector), stores it in its registry and answers the voice id with the prompt. A START
request may then carry ``voice_id`` instead of the three prompt tensors. Ids are digests of the prompt, the
same on every server; an utterance made by ``Voice.utterance`` keeps the prompt too, so when a server does not
hold the voice (another server after a failover, a restart, an eviction) the client sends the prompt itself.

Example::

    from s3flow_client.voices import read_reference, register_voice
    wav, rate = read_reference("ref.wav")
    voice = register_voice("127.0.0.1:8001", wav, rate)
    client.synthesize([voice.utterance(speech_tokens, seed=0)])
"""
from __future__ import annotations


from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from s3flow_contract.tensors import PROMPT, VOICE_ENCODER_INPUTS, VOICE_ENCODER_OUTPUTS, VOICE_ID, by_name

from .audio import read_wav
from .channel import Channel
from .stream import Utterance
from .wire import infer_inputs, requested_outputs

MODEL = "voice_encoder"


@dataclass
class Voice:
    voice_id: str
    prompt_tokens: np.ndarray         # (Np,) int64
    prompt_mel: np.ndarray            # (2 Np, 80) float32, frames-major
    speaker_embedding: np.ndarray     # (192,) float32

    def utterance(self, speech_tokens: np.ndarray, **options) -> Utterance:
        """An utterance that starts by voice id (and falls back to the prompt where the id is unknown)."""
        return Utterance(speech_tokens, self.prompt_tokens, self.prompt_mel, self.speaker_embedding,
                         voice_id=self.voice_id, **options)


def read_reference(path) -> tuple[np.ndarray, int]:
    """A mono reference recording: float32 samples and its sample rate (``audio.read_wav``); ValueError for a
    file with several channels (mix it down first)."""
    samples, rate = read_wav(path)
    if samples.ndim != 1:
        raise ValueError(f"{path}: {samples.shape[1]} channels; the reference must be mono (mix it down first)")
    return samples, rate


def _arrays(**values) -> dict[str, np.ndarray]:
    """The voice encoder's input tensors, with the dtypes ``s3flow_contract.tensors.VOICE_ENCODER_INPUTS`` declares."""
    spec = by_name(VOICE_ENCODER_INPUTS)
    return {name: np.ascontiguousarray(value, dtype=spec[name].np_dtype) for name, value in values.items()}


def _call(url: str, inputs: dict, outputs: tuple[str, ...], channel: Optional[Channel]) -> dict:
    channel = channel or Channel()
    client = channel.connect(url)
    try:
        result = client.infer(MODEL, infer_inputs(inputs, VOICE_ENCODER_INPUTS), headers=channel.headers,
                              outputs=requested_outputs(t for t in VOICE_ENCODER_OUTPUTS if t.name in outputs))
        return {n: result.as_numpy(n) for n in outputs}
    finally:
        client.close()


def _voice(out: dict) -> Voice:
    return Voice(out["voice_id"].reshape(-1)[0].decode(), out["prompt_tokens"], out["prompt_mel"],
                 out["speaker_embedding"])


_PROMPT_OUT = (VOICE_ID,) + PROMPT


def register_voice(url: str, wav: np.ndarray, sample_rate: int, channel: Optional[Channel] = None) -> Voice:
    """Register a reference (mono float32 samples at their own rate); the server checks it (1-20 s, no NaN,
    not silent, a supported rate) and answers INVALID_ARG naming what is wrong."""
    return _voice(_call(url, _arrays(wav=wav, sample_rate=[sample_rate]), _PROMPT_OUT, channel))


def register_prompt(url: str, prompt_tokens: np.ndarray, prompt_mel: np.ndarray,
                    speaker_embedding: np.ndarray, channel: Optional[Channel] = None) -> Voice:
    """Register a prompt made elsewhere (e.g. Chatterbox's ``conds.pt``, see ``read_conds``)."""
    return _voice(_call(url, _arrays(prompt_tokens=prompt_tokens, prompt_mel=prompt_mel,
                                     speaker_embedding=speaker_embedding), _PROMPT_OUT, channel))


def list_voices(url: str, channel: Optional[Channel] = None) -> list[str]:
    """The voice ids the server holds, most recently used first."""
    out = _call(url, _arrays(list_voices=[True]), ("voice_ids",), channel)["voice_ids"]
    return [v.decode() for v in out.reshape(-1)]


def read_conds(path) -> dict[str, np.ndarray]:
    """Chatterbox's ``conds.pt`` (its ``gen`` dict) as prompt tensors; needs torch (weights only, no code run)."""
    import torch

    data = torch.load(Path(path), map_location="cpu", weights_only=True)
    gen = data.get("gen", data) if isinstance(data, dict) else None
    if not isinstance(gen, dict) or not {"prompt_token", "prompt_feat", "embedding"} <= set(gen):
        raise ValueError(f"{path}: not a Chatterbox conds file (want a 'gen' dict with prompt_token, "
                         "prompt_feat, embedding)")
    tokens = gen["prompt_token"].reshape(-1).long().numpy()
    feat = gen["prompt_feat"].reshape(-1, gen["prompt_feat"].shape[-1]).float().numpy()
    n = min(tokens.size, feat.shape[0] // 2)
    return {"prompt_tokens": tokens[:n], "prompt_mel": np.ascontiguousarray(feat[:2 * n]),
            "speaker_embedding": gen["embedding"].reshape(-1).float().numpy()}
