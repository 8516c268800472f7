"""The served vocoder's runner: its two networks over ONNX Runtime (CPU) or torch (CPU or CUDA), chosen by config.

The HiFT port runs as two stateless networks with the numpy excitation between them
(``s3flow.model.vocoder_source``): ``f0`` (mel -> F0 in float64) and ``decode`` (mel, harmonics -> audio). The
served ``vocoder`` model runs them either as the graphs ``f0.onnx`` and ``decoder.onnx`` in ONNX Runtime on the
CPU (:class:`OnnxVocoder`, ``vocoder_backend onnx``; exported by ``s3flow.runtime.vocoder.export_vocoder`` with
the contract's tensor names), or as the torch module (``s3flow.runtime.torch_vocoder.TorchVocoder``, weights in
:data:`VOCODER_WEIGHTS_FILE`; ``vocoder_backend torch``). This module imports torch only for the torch backend:
the CPU host's vocoder stub starts without it.

Example::

    runner = open_vocoder_runner("model_repository/vocoder/1", VocoderRunnerSettings(backend="onnx", threads=1))
    f0 = runner.f0(mel)                              # (B, T) float64 Hz
    audio = runner.decode(mel, harmonics)            # (B, 480 T) float32
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

from s3flow_contract import tensors as contract
from s3flow.protocol import parameter_bool
from s3flow.runtime.devices import instance_device

#: Tensor names of the two exported graphs (from the contract).
F0_INPUTS, F0_OUTPUTS = (list(contract.names(ts)) for ts in contract.HIFT_F0)
DECODER_INPUTS, DECODER_OUTPUTS = (list(contract.names(ts)) for ts in contract.HIFT_DECODER)
#: ``vocoder_backend`` values; ``auto`` resolves by target: torch on GPU hosts, onnx on CPU hosts.
VOCODER_BACKENDS = ("onnx", "torch")
#: The torch backend's weights in the model's version folder (``write_vocoder_checkpoint``'s format).
VOCODER_WEIGHTS_FILE = "hift.safetensors"
GRAPH_FILES = ("f0.onnx", "decoder.onnx")


class OnnxVocoder:
    """The two callables, over ONNX Runtime (CPU) sessions of ``f0.onnx`` and ``decoder.onnx`` in a folder.

    The sessions are the estimator's (``s3flow.runtime.ort.OrtModel``: one place for the session settings, the
    memory pattern off among them), without its graph rewrite (Mish and attention: the vocoder has neither).
    ``threads``: intra-op threads, 0 = ONNX Runtime's default; ``spinning``: idle pool threads spin for work.
    """

    def __init__(self, directory, threads: int = 0, spinning: bool = True):
        from s3flow.runtime.ort import OrtModel, OrtSettings   # here: the torch backend never loads onnxruntime

        settings = OrtSettings(threads=threads, spinning=spinning, rewrite=False)
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
    """How the ``vocoder`` model runs its two networks: the ``vocoder_backend``, ``intra_op_threads`` and
    ``allow_spinning`` config parameters and the instance's placement (``KIND_GPU`` -> ``cuda:<device id>``)."""
    backend: str = "onnx"
    device: str = "cpu"
    threads: int = 0                    # ONNX Runtime intra-op / torch CPU threads; 0: the library's default
    spinning: bool = True               # ONNX Runtime: idle pool threads spin for work

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
        spinning = parameter_bool("allow_spinning", str(params.get("allow_spinning") or "true"))
        device = instance_device(instance_kind, device_id)
        if backend == "onnx" and device != "cpu":
            raise ValueError("vocoder_backend onnx runs ONNX Runtime on the CPU: give it a KIND_CPU instance "
                             "group, or use vocoder_backend torch on the GPU")
        return cls(backend=backend, device=device, threads=threads, spinning=spinning)


def open_vocoder_runner(directory: Union[str, Path], settings: VocoderRunnerSettings):
    """The ``f0`` / ``decode`` callables over a model version folder: ``f0.onnx`` + ``decoder.onnx``
    (onnx) or ``hift.safetensors`` (torch, on ``settings.device``)."""
    if settings.backend == "onnx":
        return OnnxVocoder(directory, threads=settings.threads, spinning=settings.spinning)
    if settings.backend != "torch":
        raise ValueError(f"vocoder backend must be one of {VOCODER_BACKENDS}, got {settings.backend!r}")
    path = Path(directory) / VOCODER_WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"vocoder weights not found: {path}")
    import torch   # here: the onnx backend's stub never loads torch

    from s3flow.model.vocoder import load_vocoder
    from s3flow.runtime.torch_vocoder import TorchVocoder

    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"vocoder device {settings.device} but torch sees no CUDA device")
    if settings.device == "cpu" and settings.threads:
        torch.set_num_threads(settings.threads)
    return TorchVocoder(load_vocoder(path), settings.device)
