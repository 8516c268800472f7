"""What a device check runs: its sizes (:class:`Plan`), seeded random flows and utterances, and one flow on
the CPU (the fp32 reference) and on the device with the torch backend's estimator modes (:class:`FlowModes`)."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from s3flow_contract import tensors as contract
from s3flow.model.flow import FlowConfig, S3Flow, synthesize
from s3flow.model.solver import FrameNoise
from s3flow.runtime.torch_runner import TorchRunner


@dataclass
class Plan:
    """Sizes of one run (full or quick)."""
    size: str
    prompt_tokens: int
    speech_tokens: int
    frames: tuple
    batches: tuple
    warmup: int
    iters: int
    trt_max_batch: int
    trt_max_frames: int
    steps: int = 10            # guided Euler steps (meanflow: 2)
    scale_rows: tuple = (2, 8, 32, 64, 128, 256)   # the scaling section's estimator rows (2 per guided stream)
    scale_frames: tuple = (64, 150, 300)           # and frames per row
    scale_encoder_batches: tuple = (1, 8, 32, 128)
    scale_encoder_tokens: int = 75                  # a chunk's encoder input: prompt + context + new tokens


FULL = Plan("full", 50, 100, (100, 300, 600), (1, 2, 4, 8, 16), 3, 10, 2, 1000)
QUICK = Plan("small", 6, 12, (32,), (1, 2), 0, 1, 2, 128, steps=3, scale_rows=(2, 4), scale_frames=(16,),
             scale_encoder_batches=(1, 2), scale_encoder_tokens=12)


def random_flow(config: FlowConfig, seed: int) -> S3Flow:
    """Seeded random weights in memory (the project's own when importable: it needs safetensors)."""
    try:
        from s3flow.model.random_checkpoint import random_flow as project_random_flow
        return project_random_flow(config, seed)
    except ImportError:
        torch.manual_seed(seed)
        flow = S3Flow(config)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():  # biases, norms off their fixed initial values, as random_checkpoint.perturb_parameters
            for name, p in flow.named_parameters():
                if name.endswith("bias") or "norm" in name or "time_embed_mixer" in name:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
        return flow.eval()


@dataclass
class Utterance:
    speech: torch.Tensor      # (N,) int64
    prompt: torch.Tensor      # (Np,) int64
    prompt_mel: torch.Tensor  # (2 Np, n_feats) frames-major
    xvector: torch.Tensor     # (192,)
    seed: int


def utterance(plan: Plan, seed: int, n_feats: int = 80) -> Utterance:
    g = torch.Generator().manual_seed(seed)
    return Utterance(torch.randint(0, contract.VOCAB_SIZE, (plan.speech_tokens,), generator=g),
                     torch.randint(0, contract.VOCAB_SIZE, (plan.prompt_tokens,), generator=g),
                     -3.0 + 1.5 * torch.randn(2 * plan.prompt_tokens, n_feats, generator=g),
                     torch.randn(contract.XVECTOR_DIM, generator=g), seed)


def initial_noise(u: Utterance, n_feats: int) -> torch.Tensor:
    """(1, n_feats, T) the utterance's whole starting noise (FrameNoise: the served path's too)."""
    z = FrameNoise(u.seed, n_feats).full(2 * len(u.prompt), 2 * len(u.speech))
    return torch.from_numpy(z)[None]


def request(u: Utterance, steps: int, speech: torch.Tensor | None = None, start: bool = True) -> dict:
    """The request tensors of ``u`` (``speech``: a chunk of its tokens; START-only tensors only with ``start``)."""
    speech = u.speech if speech is None else speech
    if not start:
        return contract.request_arrays(speech.numpy())
    return contract.request_arrays(speech.numpy(), start=True, prompt_tokens=u.prompt.numpy(),
                                   prompt_mel=u.prompt_mel.numpy(), speaker_embedding=u.xvector.numpy(),
                                   n_timesteps=steps, seed=u.seed)


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def flops(config, batch: int, frames: int):
    try:  # the project's analytic count (s3flow.model.flops) where present
        from s3flow.model.flops import estimator_flops
        return estimator_flops(config, batch, frames).total
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------------
# report


class FlowModes:
    """One model on the CPU (reference) and on the device, with the device estimator in each mode."""

    def __init__(self, flow: S3Flow, device: torch.device):
        self.cpu = flow
        self.dev = copy.deepcopy(flow).to(device)
        self.device = device
        self.runners = {m: TorchRunner(self.dev.estimator, "estimator", device, "fp32" if m in ("fp32", "tf32") else m)
                        for m in ("fp32", "tf32", "bf16", "fp16")}
        self._half = None

    def estimator(self, mode: str):
        if mode == "half":  # information only: the naive cast
            if self._half is None:
                self._half = copy.deepcopy(self.dev.estimator).half()

            def half(inputs):
                with torch.inference_mode():
                    return self._half(**{k: v.half() for k, v in inputs.named().items()}).float()
            return half
        runner = self.runners[mode]
        set_tf32(mode == "tf32")
        return runner.estimator

    def synthesize(self, u: Utterance, *, on_device: bool, estimator=None, steps=None,
                   z: torch.Tensor | None = None) -> torch.Tensor:
        """``z``: (1, n_feats, T) the starting noise (default: the utterance's own, ``initial_noise``)."""
        flow, dev = (self.dev, self.device) if on_device else (self.cpu, torch.device("cpu"))
        n_feats = flow.config.n_feats
        z = initial_noise(u, n_feats) if z is None else z
        out = synthesize(flow, u.speech[None].to(dev), u.prompt[None].to(dev), u.prompt_mel[None].to(dev),
                         u.xvector[None].to(dev), speech_token_len=torch.tensor([len(u.speech)], device=dev),
                         z=z.to(dev), estimator=estimator, n_steps=steps)
        return out.mel

