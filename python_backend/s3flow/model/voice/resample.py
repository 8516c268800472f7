"""Band-limited resampling, numerically the definition torchaudio's ``resample`` uses by default.

Upstream Chatterbox resamples the reference wav with ``torchaudio.transforms.Resample(orig, new)``: windowed
sinc interpolation (``sinc_interp_hann``, ``lowpass_filter_width = 6``, ``rolloff = 0.99``) whose polyphase
kernel is built in float64 and stored as float32, applied as one strided ``conv1d``. Other resamplers
(scipy, soxr) move S3Gen's prompt mel by 0.07-0.15 and change about a tenth of the tokens, so this module
follows that definition step by step instead (torchaudio itself cannot be imported beside our CPU torch).

The rates are reduced by their gcd to ``orig' / new'``; output sample ``j`` is
``sum_i x[i] * h(i / orig' - j / new')`` with ``h(t) = scale * sinc(pi * f_c * t) * cos^2(pi * f_c * t / (2 w))``
on ``|f_c t| <= w`` (``f_c = min(orig', new') * rolloff``, ``w = lowpass_filter_width``, ``scale = f_c / orig'``),
and the output has ``ceil(n * new' / orig')`` samples.

Example::

    from s3flow.model.voice.resample import resample
    wav16 = resample(torch.randn(1, 44100), 44100, 16000)   # (1, 16000)
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99


def sinc_resample_kernel(orig_freq: int, new_freq: int, lowpass_filter_width: int = LOWPASS_FILTER_WIDTH,
                         rolloff: float = ROLLOFF) -> tuple[torch.Tensor, int]:
    """The polyphase kernel for ``orig_freq -> new_freq`` (rates in Hz, any common factor allowed).

    Returns:
        kernel: (new', 1, 2 * width + orig') float32, one row per output phase.
        width: Samples of context on each side (``ceil(lowpass_filter_width * orig' / f_c)``).
    """
    if int(orig_freq) != orig_freq or int(new_freq) != new_freq or orig_freq <= 0 or new_freq <= 0:
        raise ValueError(f"sample rates must be positive integers, got {orig_freq} and {new_freq}")
    if lowpass_filter_width <= 0:
        raise ValueError(f"lowpass_filter_width must be positive, got {lowpass_filter_width}")
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    # Input offsets in float64; output phases as torchaudio forms them (int64 / int -> default float32),
    # then promoted to float64 by the sum: the float32 rounding of j / new' is part of the definition.
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    phase = torch.arange(0, -new, -1)[:, None, None] / new
    t = (phase + idx) * base_freq
    t = t.clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0, dtype=t.dtype), t.sin() / t)
    kernel = kernel * (window * (base_freq / orig))
    return kernel.to(torch.float32), width


@lru_cache(maxsize=32)
def _cached_kernel(orig_freq: int, new_freq: int) -> tuple[torch.Tensor, int]:
    return sinc_resample_kernel(orig_freq, new_freq)


def output_length(n: int, orig_freq: int, new_freq: int) -> int:
    """Samples out for ``n`` samples in: ``ceil(n * new' / orig')``."""
    gcd = math.gcd(int(orig_freq), int(new_freq))
    return math.ceil((int(new_freq) // gcd) * n / (int(orig_freq) // gcd))


def resample(waveform: torch.Tensor, orig_freq: int, new_freq: int) -> torch.Tensor:
    """Resample the last axis of ``waveform`` (..., n) float from ``orig_freq`` to ``new_freq`` Hz.

    Equal rates return the input itself. Returns (..., ceil(n * new' / orig')) in the input's dtype
    (the kernel is float32, as torchaudio's default).
    """
    if not waveform.is_floating_point():
        raise TypeError(f"resample needs a floating point waveform, got {waveform.dtype}")
    if orig_freq == new_freq:
        return waveform
    kernel, width = _cached_kernel(int(orig_freq), int(new_freq))
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig = int(orig_freq) // gcd
    shape = waveform.shape
    flat = waveform.reshape(-1, shape[-1])
    n_wavs, length = flat.shape
    padded = F.pad(flat, (width, width + orig))
    out = F.conv1d(padded[:, None], kernel.to(flat.dtype), stride=orig)   # (n_wavs, new', frames)
    out = out.transpose(1, 2).reshape(n_wavs, -1)[:, :output_length(length, orig_freq, new_freq)]
    return out.reshape(shape[:-1] + out.shape[-1:])
