"""The vocoder on a backend: torch on a device, its two ONNX graphs (export, ONNX Runtime), the served runner's
choice, and offline vocoding.

The HiFT port (``s3flow.model.vocoder.HiFTGenerator``) runs as two stateless networks with the numpy
excitation between them (``s3flow.model.vocoder_source``): ``f0`` (mel -> F0 in float64) and ``decode``
(mel, harmonics -> audio). The served ``vocoder`` model runs them either

* as the graphs ``f0.onnx`` and ``decoder.onnx`` in ONNX Runtime on the CPU (:class:`OnnxVocoder`,
  ``vocoder_backend onnx``), exported by :func:`export_vocoder` with the contract's tensor names
  (``s3flow_contract.tensors.HIFT_F0`` / ``HIFT_DECODER``), or
* as the torch module (:class:`TorchVocoder`, CPU or CUDA, weights in :data:`VOCODER_WEIGHTS_FILE`;
  ``vocoder_backend torch``).

:func:`open_vocoder_runner` opens either from a model version folder and :class:`VocoderRunnerSettings`;
:func:`vocode` vocodes a whole utterance offline over :class:`TorchVocoder` on the CPU, as upstream does.

Example::

    from s3flow.model.vocoder import VocoderConfig, random_vocoder
    from s3flow.runtime.vocoder import OnnxVocoder, check_vocoder_onnx, export_vocoder
    hift = random_vocoder(VocoderConfig.small(), seed=0)
    export_vocoder(hift, "out/")                    # out/f0.onnx, out/decoder.onnx
    check_vocoder_onnx(hift, "out/")                # {"f0": Hz, "audio": ..., "audio_rms": ...}
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch

from s3flow_contract import tensors as contract
from s3flow.model.vocoder import F0Float64, HiFTGenerator, load_vocoder
from s3flow.model.vocoder_source import offline_vocode
from s3flow.runtime.devices import instance_device
from s3flow.runtime.onnx_export import dynamic_axes

#: Tensor names of the two exported graphs (from the contract).
F0_INPUTS, F0_OUTPUTS = (list(contract.names(ts)) for ts in contract.HIFT_F0)
DECODER_INPUTS, DECODER_OUTPUTS = (list(contract.names(ts)) for ts in contract.HIFT_DECODER)
#: ``vocoder_backend`` values; ``auto`` resolves by target: torch on GPU hosts, onnx on CPU hosts.
VOCODER_BACKENDS = ("onnx", "torch")
#: The torch backend's weights in the model's version folder (``write_vocoder_checkpoint``'s format).
VOCODER_WEIGHTS_FILE = "hift.safetensors"
GRAPH_FILES = ("f0.onnx", "decoder.onnx")


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


def vocode(hift: HiFTGenerator, mel, seed: int = 0, fade: bool = True) -> np.ndarray:
    """Offline vocoding of one utterance as upstream S3Token2Wav does it (with the start's fade-in).

    mel: (n_feats, T) numpy or torch -> (480 T,) float32.
    """
    mel = mel.detach().cpu().numpy() if isinstance(mel, torch.Tensor) else np.asarray(mel)
    runner = TorchVocoder(hift)
    return offline_vocode(runner.f0, runner.decode, mel, hift.source_params, seed=seed, fade=fade)


class OnnxVocoder:
    """The two callables, over ONNX Runtime (CPU) sessions of ``f0.onnx`` and ``decoder.onnx`` in a folder.

    The sessions are the estimator's (``s3flow.runtime.ort.OrtModel``: one place for the session settings, the
    memory pattern off among them), without its graph rewrite (Mish and attention: the vocoder has neither).
    ``threads``: intra-op threads, 0 = ONNX Runtime's default.
    """

    def __init__(self, directory, threads: int = 0):
        from s3flow.runtime.ort import OrtModel, OrtSettings   # here: the torch backend never loads onnxruntime

        settings = OrtSettings(threads=threads, rewrite=False)
        models = []
        for name in GRAPH_FILES:
            path = Path(directory) / name
            if not path.is_file():
                raise FileNotFoundError(f"vocoder graph not found: {path}")
            models.append(OrtModel(path, settings))
        self.f0_model, self.decoder_model = models

    def f0(self, mel: np.ndarray) -> np.ndarray:
        """mel (B, C, T) float32 -> (B, T) float64 Hz."""
        return self.f0_model.run(dict(zip(F0_INPUTS, (mel,))), outputs=F0_OUTPUTS)[0]

    def decode(self, mel: np.ndarray, harmonics: np.ndarray) -> np.ndarray:
        """mel (B, C, T), harmonics (B, H + 1, 480 T) float32 -> audio (B, 480 T) float32."""
        return self.decoder_model.run(dict(zip(DECODER_INPUTS, (mel, harmonics))), outputs=DECODER_OUTPUTS)[0]


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


# ---------------------------------------------------------------------------------------------------
# The served vocoder's runner: ONNX Runtime (CPU) or torch (CPU or CUDA), chosen by config


def vocoder_backend_for(target: str, requested: str = "auto") -> str:
    """The backend a repository of ``target`` (cpu | gpu) serves: ``requested``, or for ``auto`` torch on
    the gpu target (the GPU runs HiFT) and onnx on the cpu target."""
    if requested == "auto":
        return "torch" if target == "gpu" else "onnx"
    if requested not in VOCODER_BACKENDS:
        raise ValueError(f"vocoder_backend must be 'auto' or one of {VOCODER_BACKENDS}, got {requested!r}")
    return requested


@dataclass(frozen=True)
class VocoderRunnerSettings:
    """How the ``vocoder`` model runs its two networks: the ``vocoder_backend`` and ``intra_op_threads``
    config parameters and the instance's placement (``KIND_GPU`` -> ``cuda:<device id>``)."""
    backend: str = "onnx"
    device: str = "cpu"
    threads: int = 0                    # ONNX Runtime intra-op / torch CPU threads; 0: the library's default

    @classmethod
    def from_args(cls, params: dict, instance_kind: str = "CPU", device_id: Union[int, str] = 0
                  ) -> "VocoderRunnerSettings":
        backend = (params.get("vocoder_backend") or "onnx").lower()
        if backend not in VOCODER_BACKENDS:
            raise ValueError(f"parameter vocoder_backend must be one of {VOCODER_BACKENDS}, got {backend!r}")
        try:
            threads = int(params.get("intra_op_threads") or 0)
        except ValueError:
            raise ValueError(f"parameter intra_op_threads must be an integer, "
                             f"got {params.get('intra_op_threads')!r}") from None
        device = instance_device(instance_kind, device_id)
        if backend == "onnx" and device != "cpu":
            raise ValueError("vocoder_backend onnx runs ONNX Runtime on the CPU: give it a KIND_CPU instance "
                             "group, or use vocoder_backend torch on the GPU")
        return cls(backend=backend, device=device, threads=threads)


def open_vocoder_runner(directory: Union[str, Path], settings: VocoderRunnerSettings):
    """The ``f0`` / ``decode`` callables over a model version folder: ``f0.onnx`` + ``decoder.onnx``
    (onnx) or ``hift.safetensors`` (torch, on ``settings.device``)."""
    if settings.backend == "onnx":
        return OnnxVocoder(directory, threads=settings.threads)
    if settings.backend != "torch":
        raise ValueError(f"vocoder backend must be one of {VOCODER_BACKENDS}, got {settings.backend!r}")
    path = Path(directory) / VOCODER_WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"vocoder weights not found: {path}")
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"vocoder device {settings.device} but torch sees no CUDA device")
    if settings.device == "cpu" and settings.threads:
        torch.set_num_threads(settings.threads)
    return TorchVocoder(load_vocoder(path), settings.device)
