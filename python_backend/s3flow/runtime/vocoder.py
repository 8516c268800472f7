"""The vocoder in torch: its two ONNX graphs' export and check, and offline vocoding.

The HiFT port (``s3flow.model.vocoder.HiFTGenerator``) runs as two stateless networks with the numpy
excitation between them (``s3flow.model.vocoder_source``): ``f0`` (mel -> F0 in float64) and ``decode``
(mel, harmonics -> audio). The served ``vocoder`` model runs them either

* as the graphs ``f0.onnx`` and ``decoder.onnx`` in ONNX Runtime on the CPU (``vocoder_runner.OnnxVocoder``,
  ``vocoder_backend onnx``), exported by :func:`export_vocoder` with the contract's tensor names
  (``s3flow_contract.tensors.HIFT_F0`` / ``HIFT_DECODER``), or
* as the torch module (``s3flow.runtime.torch_vocoder.TorchVocoder``, CPU or CUDA, weights in
  ``vocoder_runner.VOCODER_WEIGHTS_FILE``; ``vocoder_backend torch``).

``s3flow.runtime.vocoder_runner.open_vocoder_runner`` opens either from a model version folder; :func:`vocode`
vocodes a whole utterance offline over ``TorchVocoder`` on the CPU, as upstream does.

Example::

    from s3flow.model.vocoder import VocoderConfig, random_vocoder
    from s3flow.runtime.vocoder import check_vocoder_onnx, export_vocoder
    hift = random_vocoder(VocoderConfig.small(), seed=0)
    export_vocoder(hift, "out/")                    # out/f0.onnx, out/decoder.onnx
    check_vocoder_onnx(hift, "out/")                # {"f0": Hz, "audio": ..., "audio_rms": ...}
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Union

import numpy as np
import torch

from s3flow_contract import tensors as contract
from s3flow.model.vocoder import F0Float64, HiFTGenerator
from s3flow.model.vocoder_source import offline_vocode
from s3flow.runtime.onnx_export import dynamic_axes
from s3flow.runtime.torch_vocoder import TorchVocoder
from s3flow.runtime.vocoder_runner import (DECODER_INPUTS, DECODER_OUTPUTS, F0_INPUTS, F0_OUTPUTS, GRAPH_FILES,
                                           OnnxVocoder)


def vocode(hift: HiFTGenerator, mel, seed: int = 0, fade: bool = True) -> np.ndarray:
    """Offline vocoding of one utterance as upstream S3Token2Wav does it (with the start's fade-in).

    mel: (n_feats, T) numpy or torch -> (480 T,) float32.
    """
    mel = mel.detach().cpu().numpy() if isinstance(mel, torch.Tensor) else np.asarray(mel)
    runner = TorchVocoder(hift)
    return offline_vocode(runner.f0, runner.decode, mel, hift.source_params, seed=seed, fade=fade)


def export_vocoder(hift: HiFTGenerator, out_dir: Union[str, Path], opset: int = 17) -> tuple[Path, Path]:
    """Export ``f0.onnx`` (mel (B, C, T) float32 -> f0 (B, T) float64, see ``F0Float64``) and
    ``decoder.onnx`` (mel, harmonics (B, H + 1, 480 T) -> audio (B, 480 T), float32) into ``out_dir``,
    weight norms folded, batch and time dynamic (mel and F0 in ``frames``, harmonics and audio in ``samples``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = hift.folded()
    c = model.config
    gen = torch.Generator().manual_seed(0)
    mel = torch.randn(2, c.in_channels, 23, generator=gen)
    harmonics = 0.1 * torch.randn(2, c.nb_harmonics + 1, 23 * c.hop_samples, generator=gen)
    f0_path, dec_path = (out_dir / name for name in GRAPH_FILES)
    (f0_in, f0_out), (dec_in, dec_out) = contract.HIFT_F0, contract.HIFT_DECODER
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Constant folding - Only steps=1")
        torch.onnx.export(F0Float64(model.f0_predictor).eval(), (mel,), str(f0_path), dynamo=False,
                          opset_version=opset, input_names=F0_INPUTS, output_names=F0_OUTPUTS,
                          do_constant_folding=True, dynamic_axes=dynamic_axes(f0_in + f0_out, "frames"))
        torch.onnx.export(model, (mel, harmonics), str(dec_path), dynamo=False, opset_version=opset,
                          input_names=DECODER_INPUTS, output_names=DECODER_OUTPUTS, do_constant_folding=True,
                          dynamic_axes={**dynamic_axes(dec_in[:1], "frames"),
                                        **dynamic_axes(dec_in[1:] + dec_out, "samples")})
    return f0_path, dec_path


def check_vocoder_onnx(hift: HiFTGenerator, out_dir: Union[str, Path], frames: int = 37, seed: int = 0) -> dict:
    """ONNX Runtime against torch on random mel (B = 2, a T unlike the export's): worst abs errors.

    Returns ``{"f0": Hz, "audio": samples, "audio_rms": reference RMS}``.
    """
    c = hift.config
    gen = torch.Generator().manual_seed(seed)
    mel = (-4.0 + 1.5 * torch.randn(2, c.in_channels, frames, generator=gen)).numpy()
    harmonics = (0.1 * torch.randn(2, c.nb_harmonics + 1, frames * c.hop_samples, generator=gen)).numpy()
    ref, ort_ = TorchVocoder(hift), OnnxVocoder(out_dir)
    a_ref, a_ort = ref.decode(mel, harmonics), ort_.decode(mel, harmonics)
    f_ref, f_ort = ref.f0(mel), ort_.f0(mel)
    if a_ref.shape != a_ort.shape or f_ref.shape != f_ort.shape:
        raise AssertionError(f"shapes differ: audio {a_ort.shape} vs {a_ref.shape}, f0 {f_ort.shape} vs {f_ref.shape}")
    return {"f0": float(np.abs(f_ref - f_ort).max()), "audio": float(np.abs(a_ref - a_ort).max()),
            "audio_rms": float(np.sqrt(np.mean(a_ref ** 2)))}
