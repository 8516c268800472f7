"""Audio files and pictures: the project's one WAV reader and writer (``read_wav``, ``write_wav``: soundfile,
so every PCM width and float WAV reads, scaled as soundfile and librosa scale them), a .wav written as the
samples stream in (``WavWriter``), and a picture of the waveform over the mel.

Example::

    from s3flow_client.audio import WavWriter, read_wav, save_audio_png
    samples, rate = read_wav("ref.wav")            # (n,) float32 for mono, (n, channels) otherwise
    with WavWriter("out/audio_0.wav") as wav:      # 16-bit PCM, mono, 24 kHz
        for chunk in chunks:                        # float32 samples in [-1, 1]
            wav.write(chunk)
    save_audio_png(audio, mel, "out/audio_0.png")
"""
from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from s3flow_contract.tensors import SAMPLES_PER_FRAME

SAMPLE_RATE = 24000


def to_pcm16(audio: np.ndarray) -> bytes:
    """float samples in [-1, 1] -> little-endian 16-bit PCM bytes (clipped, rounded)."""
    audio = np.clip(np.asarray(audio, dtype=np.float64).reshape(-1), -1.0, 1.0)
    return np.round(audio * 32767.0).astype("<i2").tobytes()


class WavWriter:
    """A mono 16-bit PCM .wav file that grows with every ``write``; the header is final on ``close``.

    The header is rewritten after every chunk (the ``wave`` module patches the sizes when the file is
    seekable), so a player can open the file while the utterance is still streaming.
    """

    def __init__(self, path, sample_rate: int = SAMPLE_RATE):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = wave.open(str(self.path), "wb")
        self._file.setnchannels(1)
        self._file.setsampwidth(2)
        self._file.setframerate(sample_rate)
        self.samples = 0

    def write(self, audio: np.ndarray) -> None:
        audio = np.asarray(audio).reshape(-1)
        if audio.size:
            self._file.writeframes(to_pcm16(audio))
            self.samples += audio.size

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "WavWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_wav(path) -> tuple[np.ndarray, int]:
    """Samples as float32 ((n,) mono, (n, channels) otherwise; integer PCM scaled by 2^(bits - 1)) and the
    file's sample rate; ValueError naming the file for what it cannot read."""
    import soundfile

    try:
        samples, rate = soundfile.read(str(path), dtype="float32", always_2d=False)
    except (RuntimeError, soundfile.LibsndfileError) as exc:
        raise ValueError(f"{path}: not a readable audio file ({exc})") from None
    return samples, int(rate)


def write_wav(path, samples: np.ndarray, rate: int, float32: bool = False) -> Path:
    """Write samples ((n,) or (n, channels)) as 16-bit PCM (or float32) at ``rate``; returns the path."""
    import soundfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = np.asarray(samples, dtype=np.float32)
    soundfile.write(str(path), data if float32 else np.clip(data, -1.0, 1.0), int(rate),
                    subtype="FLOAT" if float32 else "PCM_16")
    return path


def save_audio_png(audio: np.ndarray, mel: np.ndarray, path, title: str = "", seams=(),
                   sample_rate: int = SAMPLE_RATE) -> None:
    """The waveform (top) over the mel spectrogram (bottom) on one time axis.

    audio: (S,) samples; mel: (n_feats, frames) at ``sample_rate / 480`` frames per second; ``seams``:
    sample indices where streamed responses joined, drawn as thin lines on the waveform.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    audio = np.asarray(audio).reshape(-1)
    seconds = max(audio.size / sample_rate, mel.shape[1] * SAMPLES_PER_FRAME / sample_rate, 1e-3)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(max(6.0, 2.5 * seconds), 4.8),
                                      gridspec_kw={"height_ratios": [1, 1.3]})
    t = np.arange(audio.size) / sample_rate
    top.plot(t, audio, lw=0.4, color="tab:blue")
    for s in seams:
        top.axvline(s / sample_rate, color="tab:red", lw=0.5, alpha=0.5)
    peak = float(np.abs(audio).max()) if audio.size else 1.0
    top.set_ylim(-1.05 * peak - 1e-6, 1.05 * peak + 1e-6)
    top.set_ylabel("amplitude")
    top.set_title(title or f"{audio.size} samples, {mel.shape[1]} mel frames")
    bottom.imshow(mel, origin="lower", aspect="auto", interpolation="nearest", cmap="magma",
                  extent=[0, mel.shape[1] * SAMPLES_PER_FRAME / sample_rate, 0, mel.shape[0]])
    bottom.set_ylabel("mel bin")
    bottom.set_xlabel("time (s)")
    bottom.set_xlim(0, seconds)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
