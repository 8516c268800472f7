"""The vocoder module on a torch device: the two callables ``VocoderStream`` runs (``vocoder_backend torch``).

``s3flow.runtime.vocoder_runner.open_vocoder_runner`` opens it from a model version folder (the weights file
``VOCODER_WEIGHTS_FILE``), importing this module only for the torch backend: a CPU host's vocoder stub runs ONNX
Runtime and imports no torch.

Example::

    from s3flow.model.vocoder import VocoderConfig, random_vocoder
    runner = TorchVocoder(random_vocoder(VocoderConfig.small(), seed=0), "cuda")
    f0 = runner.f0(mel)                      # (B, 80, T) float32 -> (B, T) float64 Hz
"""
from __future__ import annotations

import contextlib
from typing import Union

import numpy as np
import torch

from s3flow.model.vocoder import F0Float64, HiFTGenerator


class TorchVocoder:
    """The two callables ``VocoderStream`` runs, over a torch HiFTGenerator (numpy in, numpy out).

    ``device`` ``cpu`` or ``cuda[:N]``: weights folded and moved there, fp32 (F0 in float64, see
    ``F0Float64``). On CUDA, TF32 is off during the calls (cuDNN enables it for convolutions by default, which
    would round the decoder to 10 mantissa bits), so the GPU runs the same arithmetic as the CPU and as
    ONNX Runtime, up to summation order.
    """

    def __init__(self, hift: HiFTGenerator, device: Union[str, torch.device] = "cpu"):
        self.device = torch.device(device)
        folded = hift.folded()
        self.f0_float64 = F0Float64(folded.f0_predictor).eval().to(self.device)
        self.hift = folded.to(self.device)

    @contextlib.contextmanager
    def _fp32(self):
        if self.device.type != "cuda":
            yield
            return
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(self.device)

    def f0(self, mel: np.ndarray) -> np.ndarray:
        """mel (B, C, T) float32 -> (B, T) float64 Hz."""
        with torch.inference_mode(), self._fp32():
            return self.f0_float64(self._tensor(mel)).cpu().numpy()

    def decode(self, mel: np.ndarray, harmonics: np.ndarray) -> np.ndarray:
        """mel (B, C, T), harmonics (B, H + 1, 480 T) float32 -> audio (B, 480 T) float32."""
        with torch.inference_mode(), self._fp32():
            return self.hift(self._tensor(mel), self._tensor(harmonics)).cpu().numpy()
