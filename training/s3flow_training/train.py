"""Training the small demo models' CFM teacher (the meanflow student: ``s3flow_training.distill``).

Teacher (``train_teacher``): the package's FlowEncoder + ConditionalDecoder in ``trained_config()``,
trained jointly with S3Gen's conditional flow-matching loss (``cfm_loss``, as upstream
``ConditionalCFM.compute_loss``)::

    t ~ U(0, 1), t <- 1 - cos(t pi / 2)                  (cosine-warped: more samples near t = 0)
    z ~ N(0, I);  y = (1 - (1 - s) t) z + t x1;  u = x1 - (1 - s) z,   s = sigma_min = 1e-6
    mu, spks, cond multiplied by 0 with probability 0.2   (zeros mean "no condition" at inference)
    loss = sum(mask * (v(y, t | mu, spks, cond) - u)^2) / (sum(mask) * n_feats)

Each example is ``prompt ++ utterance`` where, with probability ``prompt_prob``, the prompt is a segment
of another utterance of the same voice and ``cond`` holds its mel (zeros after), exactly the layout of
inference; otherwise there is no prompt and ``cond`` is all zeros. Utterances longer than ``max_tokens``
are cut to a random window (compute). The shipped weights are an exponential moving average (``EMA``).

Student: s3flow_training.distill.

Everything is seeded (``TrainSettings.seed``): a rerun with the same settings and thread count gives the
same weights.

Example::

    ds = Dataset.load("build/small_data/dataset.npz")
    teacher = train_teacher(ds, TrainSettings(teacher_steps=50))
    write_checkpoint(teacher, "teacher.safetensors")   # records trained_config()
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from s3flow.model.encoder import EncoderConfig
from s3flow.model.estimator import EstimatorConfig
from s3flow.model.flow import FlowConfig, S3Flow
from s3flow_training.data import Dataset, prompt_for

SIGMA_MIN = 1e-6
CFG_DROPOUT = 0.2


def trained_config(meanflow: bool = False) -> FlowConfig:
    """The shipped small models' sizes: the small test encoder (64 wide, 2 + 2 conformer blocks, the real
    6561-token vocabulary) and a 128-wide estimator (1 transformer block per stage, 2 mid stages).

    The estimator must be wider than the 80 mel bins: at t = 0 the velocity is ``E[x1] - z``, and a
    64-channel U-Net cannot carry the 80-dim noise z through, so its samples keep per-pixel noise. At 128
    channels it learns to cancel part of it in a 30-minute run (frame-to-frame change of its samples 2x the
    ground truth's: results/small_model.md).
    """
    est = EstimatorConfig(channels=(128,), attention_head_dim=64, n_blocks=1, num_mid_blocks=2,
                          num_heads=2, meanflow=meanflow)
    return FlowConfig(EncoderConfig.small(), est)


@dataclass
class TrainSettings:
    """Training hyper-parameters (defaults: the shipped checkpoints)."""
    seed: int = 0
    batch_size: int = 16
    prompt_prob: float = 0.5
    prompt_tokens: tuple[int, int] = (15, 50)
    max_tokens: int = 50
    # teacher
    teacher_steps: int = 1400
    teacher_lr: float = 2e-3
    warmup_steps: int = 100
    ema_decay: float = 0.995
    #: Start the estimator's output bias at the training data's mean log-mel per bin (the mean of the
    #: target velocity x1 - z), instead of 0: see ``train_teacher``.
    init_output_bias: bool = True
    #: Start the estimator's output projection weights at zero.
    zero_init_output: bool = False
    #: Start the estimator's residual branches at zero (``identity_init``).
    identity_init: bool = True
    #: Steps at the start with the condition always dropped (then 0.2): see ``train_teacher``.
    uncond_steps: int = 200
    # student
    student_rounds: int = 150
    student_batch_size: int = 8
    student_lr: float = 5e-4
    student_ema_decay: float = 0.98
    guidance_rate: float = 0.7
    fine_steps: int = 10
    keep_times: tuple[float, ...] = (0.0, 0.5, 1.0)
    grad_clip: float = 1.0
    log_every: int = 100


@dataclass
class Batch:
    """A padded batch of ``prompt ++ utterance`` examples.

    tokens: (B, N) int64 (padding 0); token_len: (B,); xvector: (B, 192); mel: (B, n_feats, 2N) the
    target (prompt region included); cond: (B, n_feats, 2N) the prompt mel, zeros after;
    mask: (B, 1, 2N) float; prompt_frames: (B,).
    """
    tokens: torch.Tensor
    token_len: torch.Tensor
    xvector: torch.Tensor
    mel: torch.Tensor
    cond: torch.Tensor
    mask: torch.Tensor
    prompt_frames: torch.Tensor


def make_batch(ds: Dataset, indices: Sequence[int], rng: np.random.Generator, prompt_prob: float,
               prompt_tokens: tuple[int, int] = (15, 50), max_tokens: Optional[int] = None) -> Batch:
    """Examples for ``indices``, each with a same-voice prompt with probability ``prompt_prob``; an
    utterance longer than ``max_tokens`` is cut to a random window of that many tokens."""
    items = []
    for i in indices:
        u = ds.utterances[i]
        if rng.random() < prompt_prob:
            pt, pm = prompt_for(ds, i, rng, *prompt_tokens)
        else:
            pt, pm = u.tokens[:0], u.mel[:, :0]
        tok, mel = u.tokens, u.mel
        if max_tokens is not None and u.n_tokens > max_tokens:
            a = int(rng.integers(0, u.n_tokens - max_tokens + 1))
            tok, mel = tok[a:a + max_tokens], mel[:, 2 * a:2 * (a + max_tokens)]
        items.append((np.concatenate([pt, tok]), np.concatenate([pm, mel], axis=1), pm.shape[1], u.voice))
    b, n = len(items), max(len(t) for t, _, _, _ in items)
    n_feats = items[0][1].shape[0]
    tokens = torch.zeros(b, n, dtype=torch.int64)
    mel = torch.zeros(b, n_feats, 2 * n)
    cond = torch.zeros(b, n_feats, 2 * n)
    token_len = torch.tensor([len(t) for t, _, _, _ in items], dtype=torch.int64)
    for k, (t, m, tp, _) in enumerate(items):
        tokens[k, :len(t)] = torch.from_numpy(t)
        mel[k, :, :m.shape[1]] = torch.from_numpy(m)
        cond[k, :, :tp] = torch.from_numpy(m[:, :tp])
    mask = (torch.arange(2 * n)[None, :] < 2 * token_len[:, None]).float()[:, None, :]
    xvector = torch.from_numpy(np.stack([ds.xvectors[v] for _, _, _, v in items]))
    return Batch(tokens, token_len, xvector, mel * mask, cond, mask,
                 torch.tensor([tp for _, _, tp, _ in items], dtype=torch.int64))


def length_batches(ds: Dataset, indices: Sequence[int], batch_size: int, rng: np.random.Generator):
    """An endless stream of batches of similar length (sorted by jittered length, order shuffled)."""
    indices = list(indices)
    while True:
        keys = np.array([ds.utterances[i].n_tokens for i in indices]) + rng.uniform(0, 8, len(indices))
        order = [indices[j] for j in np.argsort(keys)]
        groups = [order[k:k + batch_size] for k in range(0, len(order) - batch_size + 1, batch_size)]
        for g in rng.permutation(len(groups)):
            yield groups[g]


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(mask (pred - target)^2) / (sum(mask) n_feats), as upstream."""
    return ((pred - target) ** 2 * mask).sum() / (mask.sum() * pred.shape[1])


def cfm_loss(flow: S3Flow, batch: Batch, gen: torch.Generator, sigma_min: float = SIGMA_MIN,
             cfg_dropout: float = CFG_DROPOUT) -> torch.Tensor:
    """S3Gen's conditional flow-matching loss on one batch (see the module docstring)."""
    mu, mask, spks = flow.encoder(batch.tokens, batch.token_len, batch.xvector)
    x1 = batch.mel
    b = x1.shape[0]
    t = torch.rand(b, 1, 1, generator=gen)
    t = 1 - torch.cos(t * 0.5 * math.pi)
    z = torch.randn(x1.shape, generator=gen)
    y = (1 - (1 - sigma_min) * t) * z + t * x1
    u = x1 - (1 - sigma_min) * z
    keep = (torch.rand(b, generator=gen) > cfg_dropout).float()
    pred = flow.estimator(y, mask, mu * keep[:, None, None], t.reshape(b), spks * keep[:, None],
                          batch.cond * keep[:, None, None])
    return masked_mse(pred, u, mask)


@torch.no_grad()
def identity_init(estimator: torch.nn.Module) -> None:
    """Start every residual branch of the estimator at zero (weights only; the architecture is upstream's).

    Zero the output projections of each transformer block's attention and feed-forward, and the
    LayerNorm scale of each resnet block's second causal block (so it outputs Mish(0) = 0): at the start
    every stage passes its input on through its residual / 1x1 path. With upstream's Kaiming init every
    branch adds a large random signal, and the small estimator does not learn to carry its input x
    through to the output (the -z part of the velocity) in a CPU-sized run: it collapses its
    dependence on x, and its samples keep the starting noise.
    """
    from s3flow.model.estimator import BasicTransformerBlock, CausalResnetBlock1D
    for m in estimator.modules():
        if isinstance(m, BasicTransformerBlock):
            m.attn1.to_out[0].weight.zero_()
            m.ff.net[2].weight.zero_()
        elif isinstance(m, CausalResnetBlock1D):
            m.block2.block[2].weight.zero_()


def mean_mel(ds: Dataset) -> torch.Tensor:
    """(n_feats,) mean log-mel per bin over the training split."""
    mel = np.concatenate([ds.utterances[i].mel for i in ds.split(heldout=False)], axis=1)
    return torch.from_numpy(mel.mean(1).astype(np.float32))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


Log = Callable[[str], None]


def train_teacher(ds: Dataset, settings: TrainSettings = TrainSettings(), log: Log = print,
                  config: Optional[FlowConfig] = None) -> S3Flow:
    """Train encoder + estimator from scratch with ``cfm_loss`` for ``settings.teacher_steps`` steps.

    Starting points that make the CPU-sized run learn (each a ``TrainSettings`` switch): residual branches
    at zero (``identity_init``); the output bias at the mean log-mel, so the first velocities already point
    from noise towards speech on average; the first ``uncond_steps`` steps train the unconditional field only
    (condition always dropped), then dropout 0.2 as upstream; EMA weights shipped. These came from trial runs
    of the session that wrote them, not from an ablation: results/small_model.md measures only the outcome.
    """
    s = settings
    torch.manual_seed(s.seed)
    flow = S3Flow(config or trained_config())
    if s.identity_init:
        identity_init(flow.estimator)
    with torch.no_grad():
        if s.zero_init_output:
            flow.estimator.final_proj.weight.zero_()
        if s.init_output_bias:
            flow.estimator.final_proj.bias.copy_(mean_mel(ds))
    flow.train()
    opt = torch.optim.AdamW(flow.parameters(), lr=s.teacher_lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = np.random.default_rng([s.seed, 10])
    gen = torch.Generator().manual_seed(s.seed + 11)
    batches = length_batches(ds, ds.split(heldout=False), s.batch_size, rng)
    t0, recent = time.perf_counter(), []
    ema = EMA(flow, s.ema_decay)
    for step in range(s.teacher_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s.teacher_steps, s.teacher_lr, s.warmup_steps)
        batch = make_batch(ds, next(batches), rng, s.prompt_prob, s.prompt_tokens, s.max_tokens)
        loss = cfm_loss(flow, batch, gen, cfg_dropout=1.0 if step < s.uncond_steps else CFG_DROPOUT)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(flow.parameters(), s.grad_clip)
        opt.step()
        ema.update(flow, step)
        recent.append(loss.item())
        if (step + 1) % s.log_every == 0 or step + 1 == s.teacher_steps:
            log(f"teacher step {step + 1}/{s.teacher_steps}: loss {np.mean(recent):.4f} "
                f"({time.perf_counter() - t0:.0f} s)")
            recent = []
    ema.copy_to(flow)
    return flow.eval()


class EMA:
    """Exponential moving average of a module's parameters (the weights that are shipped).

    The decay ramps up as ``min(decay, (1 + step) / (10 + step))`` so early weights are forgotten fast.
    """

    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in module.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, module: torch.nn.Module, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        for k, v in module.state_dict().items():
            if k in self.shadow:
                self.shadow[k].mul_(d).add_(v.detach(), alpha=1 - d)

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module) -> None:
        state = module.state_dict()
        for k, v in self.shadow.items():
            state[k].copy_(v)
