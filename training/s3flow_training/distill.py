"""Distilling the CFM teacher into a meanflow (2-step) student.

Student (``train_student``): a copy of the teacher whose estimator has the meanflow time mixer at
``[I | 0]`` (``make_student``), so it starts as exactly the teacher. The encoder is frozen (shared with the
teacher). For a batch, the *guided* teacher (w = 0.7, one 2B call per step) integrates from noise over
its own cosine grid of ``fine_steps`` steps with ``keep_times`` (0, 1/2, 1) inserted
(``guided_trajectory``), keeping its state there. The student learns the average velocity over [t, r]
between kept states::

    student(x_t, t, r | mu, spks, cond)  ~  (x_r - x_t) / (r - t)

for three pairs per example: (0, 1) (the 1-step solver), one of (0, 1/2) and (1/2, 1) (the 2-step
solver's intervals), and a random pair.

Example::

    student, info = train_student(teacher, ds, TrainSettings(student_rounds=20))
    write_checkpoint(student, "student.safetensors")   # records trained_config(meanflow=True)
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from s3flow.model.estimator import reset_time_embed_mixer
from s3flow.model.flow import FlowConfig, S3Flow
from s3flow.model.solver import ClassifierFreeGuidance, time_grid
from s3flow_training.data import Dataset
from s3flow_training.runstate import (Clock, Progress, RunState, optimizer_step, rewarm_factor, step_rng, step_seed,
                                      warm_start)
from s3flow_training.train import (EMA, STUDENT_PHASE, Log, TrainSettings, batch_plan, lr_at, make_batch,
                                   masked_mse)


def make_student(teacher: S3Flow) -> S3Flow:
    """A meanflow copy of ``teacher``: same weights, plus the time mixer at ``[I | 0]`` (so the student
    starts out giving exactly the teacher's conditional velocity, whatever r is)."""
    est_cfg = dataclasses.replace(teacher.config.estimator, meanflow=True)
    student = S3Flow(FlowConfig(copy.deepcopy(teacher.config.encoder), est_cfg))
    student.encoder.load_state_dict(teacher.encoder.state_dict())
    missing, unexpected = student.estimator.load_state_dict(teacher.estimator.state_dict(), strict=False)
    if missing != ["time_embed_mixer.weight"] or unexpected:
        raise RuntimeError(f"teacher -> student copy: missing {missing}, unexpected {unexpected}")
    reset_time_embed_mixer(student.estimator.time_embed_mixer)
    return student.eval()


def distill_grid(fine_steps: int, keep_times: Sequence[float]) -> tuple[torch.Tensor, list[int]]:
    """The fine integration grid (the cosine grid of ``fine_steps`` with ``keep_times`` inserted) and
    the grid index of each kept time."""
    grid = time_grid(fine_steps, "cosine", dtype=torch.float64)
    extra = [k for k in keep_times if (grid - k).abs().min() > 1e-6]  # 0.5 is on the 6-step grid
    grid = torch.sort(torch.cat([grid, torch.tensor(extra, dtype=torch.float64)])).values
    keep = [int(torch.argmin((grid - k).abs())) for k in keep_times]
    grid[keep] = torch.tensor(list(keep_times), dtype=torch.float64)
    return grid.float(), keep


@torch.no_grad()
def guided_trajectory(estimator, z: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor,
                      cond: torch.Tensor, rate: float, grid: torch.Tensor, keep: Sequence[int]) -> torch.Tensor:
    """Euler-integrate the guided teacher over ``grid`` from z; (len(keep), B, n_feats, T) states at the
    grid indices ``keep``."""
    field = ClassifierFreeGuidance(estimator, mu, mask, spks, cond, rate=rate)
    x, states = z.clone(), {}
    if 0 in keep:
        states[0] = x.clone()
    for i in range(grid.shape[0] - 1):
        t, r = grid[i], grid[i + 1]
        x = x + (r - t) * field(x, t, r)
        if i + 1 in keep:
            states[i + 1] = x.clone()
    return torch.stack([states[k] for k in keep])


def sample_pairs(b: int, n_keep: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Three (start, end) kept-state indices per example: the full interval, one half (the 2-step
    solver's intervals), and a random interval."""
    mid, last = n_keep // 2, n_keep - 1
    pairs = []
    for _ in range(b):
        i, j = sorted(rng.choice(n_keep, 2, replace=False).tolist())
        pairs += [(0, last), (0, mid) if rng.random() < 0.5 else (mid, last), (i, j)]
    return pairs


def train_student(teacher: S3Flow, ds: Dataset, settings: TrainSettings = TrainSettings(),
                  log: Log = print, state_path: Optional[Path] = None, budget_s: Optional[float] = None,
                  start: Optional[S3Flow] = None, start_step: int = 0,
                  max_steps: Optional[int] = None) -> tuple[S3Flow, dict]:
    """Distil ``teacher`` into a meanflow student (see the module docstring), up to
    ``settings.student_rounds`` rounds, for at most ``budget_s`` seconds this run; going on from
    ``state_path`` or from ``start`` at ``start_step`` as ``train_teacher`` does. Returns the EMA student
    (eval mode) and a record of the run."""
    s = settings
    torch.manual_seed(s.seed + 20)
    student = make_student(teacher)
    for p in student.encoder.parameters():
        p.requires_grad_(False)
    params = [p for p in student.estimator.parameters()]
    opt = torch.optim.AdamW(params, lr=s.student_lr, betas=(0.9, 0.98), weight_decay=0.0)
    ema = EMA(student.estimator, s.student_ema_decay)
    state = RunState(state_path, student.estimator, opt, ema, tag=f"student {student.config.to_dict()}")
    step, rewarm = state.load(), None
    if step:
        log(f"student: resumed at round {step} from {state_path}")
    elif start is not None:
        warm_start(student.estimator, start.estimator.state_dict(), ema)
        step = rewarm = start_step
        log(f"student: warm start at round {step} from the given weights (fresh optimiser)")
    student.estimator.train()
    grid, keep = distill_grid(s.fine_steps, s.keep_times)
    times = grid[keep]
    train_split = ds.split(heldout=False)
    teacher_est = teacher.estimator.eval()

    def teacher_velocity(inputs):   # the module as a solver estimator (under no_grad, not inference_mode)
        return teacher_est(**inputs.named())

    clock = Clock(budget_s, step, max_steps)
    progress = Progress(state, "student round", s.student_rounds, s.log_every, s.save_every, clock, log)
    while step < s.student_rounds and clock.running(step):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s.student_rounds, s.student_lr, min(s.warmup_steps, s.student_rounds // 10)) \
                * rewarm_factor(step, rewarm)
        rng = step_rng(s.seed, STUDENT_PHASE, step)
        gen = torch.Generator().manual_seed(step_seed(s.seed, STUDENT_PHASE, step))
        batch = make_batch(ds, batch_plan(ds, train_split, s.student_batch_size, s.seed + 1, step), rng,
                           s.prompt_prob, s.prompt_tokens, s.max_tokens, s.context_prob, s.context_tokens)
        with torch.no_grad():
            mu, mask, spks = teacher.encoder(batch.tokens, batch.token_len, batch.xvector)
            z = torch.randn(batch.mel.shape, generator=gen) * mask
            states = guided_trajectory(teacher_velocity, z, mu, mask, spks, batch.cond, s.guidance_rate, grid, keep)
        b = z.shape[0]
        pairs = sample_pairs(b, len(keep), rng)
        rows = torch.tensor([k // 3 for k in range(len(pairs))])
        i_idx = torch.tensor([p[0] for p in pairs])
        j_idx = torch.tensor([p[1] for p in pairs])
        x_t, x_r = states[i_idx, rows], states[j_idx, rows]
        t, r = times[i_idx], times[j_idx]
        target = (x_r - x_t) / (r - t)[:, None, None]
        pred = student.estimator(x_t, mask[rows], mu[rows], t, spks[rows], batch.cond[rows], r)
        loss = masked_mse(pred, target, mask[rows])
        optimizer_step(opt, loss, params, s.grad_clip)
        ema.update(student.estimator, step)
        step += 1
        progress.after(step, {"loss": loss.item()})
    info = progress.end(step)
    ema.copy_to(student.estimator)
    return student.eval(), info
