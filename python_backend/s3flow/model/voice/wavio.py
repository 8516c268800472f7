"""WAV files without torchaudio or soundfile: RIFF/WAVE PCM (8/16/24/32-bit) and IEEE float (32/64-bit).

``read_wav`` returns float32 samples scaled as soundfile and librosa scale them (16-bit / 32768, 24-bit / 2^23,
32-bit / 2^31, unsigned 8-bit (x - 128) / 128; float files as stored) and the file's own sample rate: no
resampling, no channel mixing. ``write_wav`` writes 16-bit PCM or float32 (tests, demos).

Example::

    samples, rate = read_wav("ref.wav")     # (n,) for mono, (n, channels) otherwise
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Union

import numpy as np

PCM, IEEE_FLOAT, EXTENSIBLE = 1, 3, 0xFFFE


def read_wav(path: Union[str, Path]) -> tuple[np.ndarray, int]:
    """Samples (n,) mono or (n, channels) float32, and the sample rate in Hz; ValueError for what it cannot read."""
    data = Path(path).read_bytes()
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError(f"{path}: not a RIFF/WAVE file")
    pos, fmt, payload = 12, None, None
    while pos + 8 <= len(data):
        chunk, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        body = data[pos + 8:pos + 8 + size]
        if chunk == b"fmt ":
            fmt = body
        elif chunk == b"data":
            payload = body
        pos += 8 + size + (size & 1)
    if fmt is None or payload is None:
        raise ValueError(f"{path}: missing {'fmt' if fmt is None else 'data'} chunk")
    tag, channels, rate, _, block, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]
    width = bits // 8
    if channels < 1 or block != channels * width:
        raise ValueError(f"{path}: inconsistent format ({channels} channels, {bits} bits, block {block})")
    n = len(payload) // block
    raw = payload[: n * block]
    if tag == PCM and bits == 8:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == PCM and bits == 16:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif tag == PCM and bits == 24:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif tag == PCM and bits == 32:
        x = (np.frombuffer(raw, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    elif tag == IEEE_FLOAT and bits in (32, 64):
        x = np.frombuffer(raw, "<f4" if bits == 32 else "<f8").astype(np.float32)
    else:
        raise ValueError(f"{path}: unsupported WAV encoding (format tag {tag}, {bits} bits)")
    x = x.reshape(n, channels)
    return (x[:, 0].copy() if channels == 1 else x), int(rate)


def write_wav(path: Union[str, Path], samples: np.ndarray, rate: int, float32: bool = False) -> Path:
    """Write (n,) or (n, channels) samples in [-1, 1] as 16-bit PCM (or float32 with ``float32``)."""
    x = np.asarray(samples, dtype=np.float32)
    x = x[:, None] if x.ndim == 1 else x
    channels = x.shape[1]
    if float32:
        raw, tag, bits = x.astype("<f4").tobytes(), IEEE_FLOAT, 32
    else:
        raw, tag, bits = (np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes(), PCM, 16)
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, int(rate), int(rate) * block, block, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(raw)) + raw
    path = Path(path)
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return path
