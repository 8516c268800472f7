"""Reference audio in, speaker prompt out: upstream ``S3Token2Mel.embed_ref`` on our own modules.

For a mono wav at its own sample rate ``sr`` (no resampling or cut beforehand), in upstream's order:

1. ``prompt_feat``: resample to 24 kHz (``voice.resample``), S3Gen's mel (``voice.mel.s3gen_mel``), frames-major
   (1, T, 80) with ``T = n24 // 480``;
2. resample the *original* samples to 16 kHz;
3. ``embedding``: CAMPPlus x-vector of the 16 kHz samples (Kaldi fbank, mean-normalised), (1, 192), not
   L2-normalised (the flow normalises it);
4. ``prompt_tokens``: S3TokenizerV2 tokens of the 16 kHz samples, (1, Np) int64;
5. when ``T != 2 Np`` (the wav is not a multiple of 40 ms) the tokens are cut to ``T // 2``. For an odd ``T``
   upstream keeps all T frames, so ``T = 2 Np + 1``; ``VoicePrompt.aligned()`` drops that last frame, which is
   what this project's START request (``prompt_mel`` of exactly 2 Np frames) takes.

Bad audio raises ValueError naming the value (``validate_wav``): empty, shorter than 1 s, longer than the limit,
NaN/Inf, not 1-D (stereo), integer PCM, unsupported sample rate, silence, samples far outside [-1, 1].
Upstream only warns above 10 s; the default limit here, 20 s, is what the START request's default 500 prompt
tokens hold.

Example::

    fe = VoiceFrontend.from_checkpoint("checkpoints/s3gen.safetensors")
    prompt = fe.embed(wav, 44100)       # VoicePrompt: prompt_tokens (1, Np), prompt_feat (1, T, 80), embedding (1, 192)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from s3flow.model.voice.campplus import CAMPPlus
from s3flow.model.voice.mel import S3GEN_SR, TOKENIZER_SR, s3gen_mel
from s3flow.model.voice.resample import resample
from s3flow.model.voice.tokenizer import S3TokenizerV2
from s3flow.model.voice.weights import VoiceConfig, load_voice_modules, random_voice_modules

#: Sample rates a reference may come in (Hz); others are refused (an odd rate makes a huge resampling kernel).
SUPPORTED_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)


@dataclass(frozen=True)
class VoiceLimits:
    """What a reference wav must satisfy (defaults in one place)."""
    min_seconds: float = 1.0
    max_seconds: float = 20.0
    #: a peak |sample| below this is silence (-60 dBFS)
    silence_peak: float = 1e-3
    #: a peak |sample| above this is not float audio in [-1, 1] (e.g. 16-bit values stored as float)
    max_peak: float = 2.0
    sample_rates: tuple = SUPPORTED_SAMPLE_RATES


@dataclass
class VoicePrompt:
    """The three prompt tensors, exactly as upstream ``embed_ref`` returns them.

    prompt_tokens: (1, Np) int64; prompt_feat: (1, T, 80) float32 (T = 2 Np, or 2 Np + 1);
    embedding: (1, 192) float32.
    """
    prompt_tokens: np.ndarray
    prompt_feat: np.ndarray
    embedding: np.ndarray

    def aligned(self) -> "VoicePrompt":
        """The same prompt with ``prompt_feat`` cut to exactly 2 frames per token (what a START carries)."""
        frames = 2 * self.prompt_tokens.shape[1]
        return VoicePrompt(self.prompt_tokens, np.ascontiguousarray(self.prompt_feat[:, :frames]), self.embedding)

    def as_dict(self) -> dict[str, np.ndarray]:
        return {"prompt_tokens": self.prompt_tokens, "prompt_feat": self.prompt_feat, "embedding": self.embedding}


def validate_wav(wav, sample_rate, limits: VoiceLimits = VoiceLimits()) -> np.ndarray:
    """Check a reference wav; return it as a contiguous float32 (n,) array or raise ValueError naming the value.

    Args:
        wav: (n,) float samples in [-1, 1] (numpy array or torch tensor).
        sample_rate: Its rate in Hz, one of ``limits.sample_rates``.
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise ValueError(f"sample_rate must be an integer number of Hz, got {sample_rate!r}")
    sample_rate = int(sample_rate)
    if sample_rate not in limits.sample_rates:
        raise ValueError(f"unsupported sample_rate {sample_rate} Hz; supported: "
                         f"{', '.join(str(r) for r in limits.sample_rates)}")
    if isinstance(wav, torch.Tensor):
        wav = wav.detach().cpu().numpy()
    wav = np.asarray(wav)
    if wav.dtype.kind in "iub":
        raise ValueError(f"wav must hold float samples in [-1, 1], got integer PCM of dtype {wav.dtype} "
                         f"(divide 16-bit samples by 32768)")
    if wav.dtype.kind != "f":
        raise ValueError(f"wav must hold float samples in [-1, 1], got dtype {wav.dtype}")
    if wav.ndim != 1:
        raise ValueError(f"wav must be mono, one 1-D array of samples, got shape {list(wav.shape)} "
                         "(mix stereo down or pick one channel)")
    n = wav.shape[0]
    if n == 0:
        raise ValueError("wav is empty (0 samples)")
    seconds = n / sample_rate
    if seconds < limits.min_seconds:
        raise ValueError(f"wav is too short: {seconds:.3f} s ({n} samples at {sample_rate} Hz), "
                         f"at least {limits.min_seconds:g} s needed")
    if seconds > limits.max_seconds:
        raise ValueError(f"wav is too long: {seconds:.3f} s ({n} samples at {sample_rate} Hz), "
                         f"at most {limits.max_seconds:g} s allowed")
    finite = np.isfinite(wav)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(f"wav holds {bad.size} NaN or Inf samples (first at sample {bad[0]}: {wav[bad[0]]})")
    peak = float(np.abs(wav).max())
    if peak < limits.silence_peak:
        raise ValueError(f"wav is silent: peak |sample| {peak:.3g} is below {limits.silence_peak:g}")
    if peak > limits.max_peak:
        raise ValueError(f"wav peak |sample| {peak:.6g} is above {limits.max_peak:g}: samples must be floats in "
                         "[-1, 1] (integer PCM stored as float?)")
    return np.ascontiguousarray(wav, dtype=np.float32)


class VoiceFrontend:
    """S3Gen's reference-audio front-end: the tokenizer, the speaker encoder and the two mels."""

    def __init__(self, tokenizer: S3TokenizerV2, speaker_encoder: CAMPPlus, limits: VoiceLimits = VoiceLimits()):
        self.tokenizer = tokenizer.eval()
        self.speaker_encoder = speaker_encoder.eval()
        self.limits = limits

    @classmethod
    def from_checkpoint(cls, path: Union[str, Path], config: Optional[VoiceConfig] = None,
                        limits: VoiceLimits = VoiceLimits()) -> "VoiceFrontend":
        """Load ``tokenizer.*`` and ``speaker_encoder.*`` from an S3Gen checkpoint (ours or upstream's)."""
        return cls(*load_voice_modules(path, config), limits=limits)

    @classmethod
    def random(cls, config: VoiceConfig, seed: int = 0, limits: VoiceLimits = VoiceLimits()) -> "VoiceFrontend":
        """Seeded random weights (tests)."""
        return cls(*random_voice_modules(config, seed), limits=limits)

    @torch.no_grad()
    def embed(self, wav, sample_rate: int) -> VoicePrompt:
        """Validate a reference and compute its prompt (see the module docstring for the steps).

        Args:
            wav: (n,) float32 samples in [-1, 1] at ``sample_rate``.
            sample_rate: Hz, one of ``self.limits.sample_rates``.
        """
        samples = validate_wav(wav, sample_rate, self.limits)
        return embed_ref(self.tokenizer, self.speaker_encoder, torch.from_numpy(samples), int(sample_rate))


@torch.no_grad()
def embed_ref(tokenizer: S3TokenizerV2, speaker_encoder: CAMPPlus, wav: torch.Tensor,
              sample_rate: int) -> VoicePrompt:
    """Upstream's ``embed_ref`` without validation: wav (n,) float32 at ``sample_rate`` -> VoicePrompt."""
    wav = wav.reshape(1, -1).float()
    wav24 = resample(wav, sample_rate, S3GEN_SR)
    feat = s3gen_mel(wav24).transpose(1, 2)                        # (1, T, 80)
    wav16 = resample(wav, sample_rate, TOKENIZER_SR)
    embedding = speaker_encoder.embed(wav16[0])                    # (1, 192)
    tokens = tokenizer.tokenize(wav16[0])                          # (1, Np)
    if feat.shape[1] != 2 * tokens.shape[1]:
        tokens = tokens[:, : feat.shape[1] // 2]
    return VoicePrompt(prompt_tokens=tokens.to(torch.int64).numpy(),
                       prompt_feat=np.ascontiguousarray(feat.float().numpy()),
                       embedding=embedding.float().numpy())
