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
    teacher, info = train_teacher(ds, TrainSettings(teacher_steps=50))
    write_checkpoint(teacher, "teacher.safetensors")   # records trained_config()
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from s3flow.model.encoder import EncoderConfig
from s3flow.model.estimator import EstimatorConfig
from s3flow.model.flow import FlowConfig, S3Flow
from s3flow_training.data import Dataset, prompt_for
from s3flow_training.runstate import (Clock, Progress, RunState, optimizer_step, rewarm_factor, step_rng, step_seed,
                                      warm_start)

SIGMA_MIN = 1e-6
CFG_DROPOUT = 0.2


def trained_config(meanflow: bool = False) -> FlowConfig:
    """The shipped small models' sizes: the small test encoder (64 wide, 2 + 2 conformer blocks, the real
    6561-token vocabulary) and a 192-wide estimator of upstream's architecture (1 transformer block per
    stage, 2 mid stages, 3 heads of 64).

    The estimator must be wider than the 80 mel bins: at t = 0 the velocity is ``E[x1] - z``, and a
    64-channel U-Net cannot carry the 80-dim noise z through, so its samples keep per-pixel noise. A
    128-wide one with 2 mid stages kept visible noise after a 30-minute run (the first shipped model); the
    width goes to 192 (results/small_model.md, *Choosing the estimator*, has the time-matched pilots).
    """
    est = EstimatorConfig(channels=(192,), attention_head_dim=64, n_blocks=1, num_mid_blocks=2,
                          num_heads=3, meanflow=meanflow)
    return FlowConfig(EncoderConfig.small(), est)


@dataclass
class TrainSettings:
    """Training hyper-parameters (defaults: the shipped checkpoints)."""
    seed: int = 0
    batch_size: int = 16
    #: Probability that an example has a same-voice speaker prompt (else: no prompt, cond all zeros).
    prompt_prob: float = 0.85
    #: Prompt length range in tokens, drawn log-uniformly once per batch (10 tokens = 0.4 s to 150 = 6 s; the
    #: old corpus' prompts were at most 2 s; 10 s, Chatterbox's longest, cost twice as much per step here),
    #: so a batch pads little.
    prompt_tokens: tuple[int, int] = (10, 150)
    #: Probability that the cond also holds the utterance's own preceding frames after the prompt (up to
    #: ``context_tokens``): what a bounded-context streaming chunk conditions on.
    context_prob: float = 0.3
    context_tokens: int = 50
    max_tokens: int = 50
    # teacher
    teacher_steps: int = 2000
    teacher_lr: float = 2e-3
    warmup_steps: int = 100
    ema_decay: float = 0.999
    #: Start the estimator's output bias at the training data's mean log-mel per bin (the mean of the
    #: target velocity x1 - z), instead of 0: see ``train_teacher``.
    init_output_bias: bool = True
    #: Start the estimator's output projection weights at zero.
    zero_init_output: bool = False
    #: Start the estimator's residual branches at zero (``identity_init``).
    identity_init: bool = True
    #: Steps at the start with the condition always dropped (then 0.2): see ``train_teacher``.
    uncond_steps: int = 100
    # student
    student_rounds: int = 300
    student_batch_size: int = 8
    student_lr: float = 5e-4
    student_ema_decay: float = 0.98
    guidance_rate: float = 0.7
    fine_steps: int = 10
    keep_times: tuple[float, ...] = (0.0, 0.5, 1.0)
    grad_clip: float = 1.0
    log_every: int = 100
    save_every: int = 200


@dataclass
class Batch:
    """A padded batch of ``prompt ++ utterance`` examples.

    tokens: (B, N) int64 (padding 0); token_len: (B,); xvector: (B, 192); mel: (B, n_feats, 2N) the
    target (prompt region included); cond: (B, n_feats, 2N) the prompt mel, zeros after;
    mask: (B, 1, 2N) float; prompt_frames: (B,) the conditioned frames (prompt and own context).
    """
    tokens: torch.Tensor
    token_len: torch.Tensor
    xvector: torch.Tensor
    mel: torch.Tensor
    cond: torch.Tensor
    mask: torch.Tensor
    prompt_frames: torch.Tensor


def draw_prompt_length(rng: np.random.Generator, prompt_tokens: tuple[int, int]) -> int:
    """A prompt length in [lo, hi] tokens, log-uniform (as many 0.4-1 s prompts as 4-10 s ones)."""
    lo, hi = prompt_tokens
    return int(min(hi, max(lo, round(np.exp(rng.uniform(np.log(lo), np.log(hi + 1)))))))


def make_batch(ds: Dataset, indices: Sequence[int], rng: np.random.Generator, prompt_prob: float,
               prompt_tokens: tuple[int, int] = (15, 50), max_tokens: Optional[int] = None,
               context_prob: float = 0.0, context_tokens: int = 0) -> Batch:
    """Examples for ``indices``: each utterance (cut to a random window of ``max_tokens`` when longer),
    with probability ``prompt_prob`` after a same-voice prompt of one length drawn for the whole batch
    (``draw_prompt_length``), and with probability ``context_prob`` with up to ``context_tokens`` of the
    utterance's own preceding tokens conditioned too (their mel in cond)."""
    n_prompt = draw_prompt_length(rng, prompt_tokens)
    items = []
    for i in indices:
        u = ds.utterances[i]
        if rng.random() < prompt_prob:
            pt, pm = prompt_for(ds, i, rng, n_prompt, n_prompt)
        else:
            pt, pm = u.tokens[:0], u.mel[:, :0]
        a, w = 0, u.n_tokens
        if max_tokens is not None and u.n_tokens > max_tokens:
            a, w = int(rng.integers(0, u.n_tokens - max_tokens + 1)), max_tokens
        c = min(a, int(rng.integers(1, context_tokens + 1))) if context_tokens and rng.random() < context_prob else 0
        pt = np.concatenate([pt, u.tokens[a - c:a]])
        pm = np.concatenate([pm, u.mel[:, 2 * (a - c):2 * a]], axis=1)
        tok, mel = u.tokens[a:a + w], u.mel[:, 2 * a:2 * (a + w)]
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


#: Phase numbers in the per-step random streams (``runstate.step_rng``).
TEACHER_PHASE, STUDENT_PHASE = 10, 20


def batch_plan(ds: Dataset, indices: Sequence[int], batch_size: int, seed: int, step: int) -> list[int]:
    """The utterances of batch ``step``: epochs of batches of similar length (sorted by jittered length),
    each epoch's batch order shuffled; a function of (seed, step) only."""
    indices = list(indices)
    groups_per_epoch = max(1, len(indices) // batch_size)
    epoch, k = divmod(step, groups_per_epoch)
    rng = np.random.default_rng([seed, 12, epoch])
    keys = np.array([ds.utterances[i].n_tokens for i in indices]) + rng.uniform(0, 8, len(indices))
    order = [indices[j] for j in np.argsort(keys, kind="stable")]
    group = int(rng.permutation(groups_per_epoch)[k])
    return order[group * batch_size:(group + 1) * batch_size]


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
                  config: Optional[FlowConfig] = None, state_path: Optional[Path] = None,
                  budget_s: Optional[float] = None, start: Optional[S3Flow] = None,
                  start_step: int = 0, max_steps: Optional[int] = None) -> tuple[S3Flow, dict]:
    """Train encoder + estimator with ``cfm_loss`` up to ``settings.teacher_steps`` steps, for at most
    ``budget_s`` seconds (and ``max_steps`` steps) this run; go on from ``state_path`` when it holds a
    state (``runstate``), else from ``start`` at ``start_step`` (committed weights), else from scratch.

    Starting points that make the CPU-sized run learn (each a ``TrainSettings`` switch): residual branches
    at zero (``identity_init``); the output bias at the mean log-mel, so the first velocities already point
    from noise towards speech on average; the first ``uncond_steps`` steps train the unconditional field only
    (condition always dropped), then dropout 0.2 as upstream; EMA weights shipped. These came from trial runs
    of the session that wrote them, not from an ablation.

    Returns the EMA weights (eval mode) and a record of the run (steps, last mean loss, wall seconds).
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
    opt = torch.optim.AdamW(flow.parameters(), lr=s.teacher_lr, betas=(0.9, 0.98), weight_decay=0.01)
    ema = EMA(flow, s.ema_decay)
    state = RunState(state_path, flow, opt, ema, tag=f"teacher {flow.config.to_dict()}")
    step, rewarm = state.load(), None
    if step:
        log(f"teacher: resumed at step {step} from {state_path}")
    elif start is not None:
        warm_start(flow, start.state_dict(), ema)
        step = rewarm = start_step
        log(f"teacher: warm start at step {step} from the given weights (fresh optimiser)")
    flow.train()
    train_split = ds.split(heldout=False)
    clock = Clock(budget_s, step, max_steps)
    progress = Progress(state, "teacher step", s.teacher_steps, s.log_every, s.save_every, clock, log)
    while step < s.teacher_steps and clock.running(step):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s.teacher_steps, s.teacher_lr, s.warmup_steps) * rewarm_factor(step, rewarm)
        rng = step_rng(s.seed, TEACHER_PHASE, step)
        torch.manual_seed(step_seed(s.seed, TEACHER_PHASE, step))   # the encoder's dropout
        gen = torch.Generator().manual_seed(step_seed(s.seed, TEACHER_PHASE + 1, step))
        batch = make_batch(ds, batch_plan(ds, train_split, s.batch_size, s.seed, step), rng, s.prompt_prob,
                           s.prompt_tokens, s.max_tokens, s.context_prob, s.context_tokens)
        loss = cfm_loss(flow, batch, gen, cfg_dropout=1.0 if step < s.uncond_steps else CFG_DROPOUT)
        optimizer_step(opt, loss, flow.parameters(), s.grad_clip)
        ema.update(flow, step)
        step += 1
        progress.after(step, {"loss": loss.item()})
    info = progress.end(step)
    ema.copy_to(flow)
    return flow.eval(), info


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
