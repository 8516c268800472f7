"""Time-boxed, resumable training runs: one phase (vocoder, teacher, student) spans several runs.

A phase has a fixed schedule (its total steps: the learning rate follows it whatever the runs), and each
run does a slice of it until the schedule ends or its time budget does. Every random choice of a step
(its batch, prompts, crops, noise, dropout) is a function of (seed, step) only (``step_rng``,
``step_seed``), so ``RunState`` needs to keep only the weights, the EMA, the optimiser and the step, which
it writes to one file outside the repository (``build/train_state/<phase>.pt``) every ``save_every``
steps and at the end of the run: a run cut in two gives the same weights as one run.

When that file is gone (a fresh clone), a phase can go on from its committed checkpoint instead
(``warm_start``): the shipped EMA weights become both the weights and the EMA, the optimiser starts
afresh with a short warm-up, and the step comes from ``training.json``.

A phase with more than one network (an adversarial one: the generator and its discriminators) names the
others in ``extra`` (anything with ``state_dict`` / ``load_state_dict``: modules, optimisers), and a run's
running numbers (the losses of the steps since the last log line) go in ``running``, so that the log and
the record of a run cut in two are those of one run too.

Every phase's loop ends its step the same way: :func:`optimizer_step` (gradients, clipped, applied) and
:class:`Progress` (the losses logged every ``log_every`` steps, the state saved every ``save_every`` and at
the end of the run, the run's record).

Example::

    state = RunState(path, model=flow, optimizer=opt, ema=ema)
    step = state.load()           # 0 when there is nothing to resume
    progress = Progress(state, "teacher step", total, log_every=100, save_every=200, clock=Clock(budget_s, step))
    while step < total and clock.running(step):
        rng = step_rng(seed, PHASE, step); ...; optimizer_step(opt, loss, flow.parameters(), 1.0)
        step += 1
        progress.after(step, {"loss": loss.item()})
    info = progress.end(step)     # saved; steps, seconds, the last logged losses
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch


class RunState:
    """The resumable state of one training phase (see the module docstring)."""

    def __init__(self, path: Optional[Path], model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema,
                 tag: str = "", extra: Optional[dict[str, Any]] = None):
        self.path = Path(path) if path is not None else None
        self.model, self.optimizer, self.ema, self.tag = model, optimizer, ema, tag
        self.extra = dict(extra or {})
        #: The running numbers of the loaded state (``save``'s ``running``; empty when there was none).
        self.running: dict = {}

    def load(self) -> int:
        """Restore the last saved state; returns its step (0 when there is none)."""
        if self.path is None or not self.path.is_file():
            return 0
        state = torch.load(self.path, weights_only=False)
        if state["tag"] != self.tag:
            raise ValueError(f"{self.path} holds the state of {state['tag']!r}, not of {self.tag!r}: "
                             "delete it to start afresh")
        missing = set(self.extra) - set(state.get("extra", {}))
        if missing:
            raise ValueError(f"{self.path} holds no state of {sorted(missing)}: delete it to start afresh")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.ema.shadow = state["ema"]
        for name, part in self.extra.items():
            part.load_state_dict(state["extra"][name])
        self.running = state.get("running", {})
        return int(state["step"])

    def save(self, step: int, running: Optional[dict] = None) -> None:
        """Write the state at ``step``; ``running``: plain numbers (lists, dicts, floats) to restore with it."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        state = {"tag": self.tag, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "ema": self.ema.shadow, "step": step}
        if self.extra:
            state["extra"] = {name: part.state_dict() for name, part in self.extra.items()}
        if running is not None:
            state["running"] = running
        torch.save(state, tmp)
        tmp.replace(self.path)   # a run killed mid-write leaves the previous state intact


def step_rng(seed: int, phase: int, step: int) -> np.random.Generator:
    """The numpy generator of one step of one phase: a function of (seed, phase, step) only."""
    return np.random.default_rng([seed, phase, step])


def step_seed(seed: int, phase: int, step: int) -> int:
    """A torch seed for one step of one phase (its noise, t, dropout), from (seed, phase, step) only."""
    return int(step_rng(seed, phase + 1000, step).integers(2 ** 62))


class Clock:
    """A run's limits: ``running(step)`` is true until ``budget_s`` seconds have passed (None: no limit)
    and, when ``max_steps`` is given, until that many steps were done since ``first_step``."""

    def __init__(self, budget_s: Optional[float], first_step: int = 0, max_steps: Optional[int] = None):
        self.budget_s, self.t0 = budget_s, time.perf_counter()
        self.first_step, self.max_steps = first_step, max_steps

    def running(self, step: int) -> bool:
        if self.max_steps is not None and step - self.first_step >= self.max_steps:
            return False
        return self.budget_s is None or self.elapsed() < self.budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def optimizer_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor, parameters: Iterable[torch.Tensor],
                   grad_clip: float) -> None:
    """One update: ``loss``'s gradients, clipped to ``grad_clip`` (their global norm), applied."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    optimizer.step()


def mean_terms(recent: list[dict[str, float]]) -> dict[str, float]:
    """Each loss term's mean over the steps that logged it (5 decimals)."""
    keys = list(dict.fromkeys(k for r in recent for k in r))
    return {k: round(float(np.mean([r[k] for r in recent if k in r])), 5) for k in keys}


class Progress:
    """A run's cadence after each step (module docstring): the loss terms since the last log line, their means
    logged as ``<name> <step>/<total>: ...`` every ``log_every`` steps and at the schedule's end (``detail()``
    adds to the line), the state saved every ``save_every`` steps and at the end, with those terms (a run cut
    in two logs and records as one run)."""

    def __init__(self, state: RunState, name: str, total: int, log_every: int, save_every: int, clock: Clock,
                 log: Callable[[str], None] = print, detail: Callable[[], str] = lambda: ""):
        self.state, self.name, self.total, self.clock, self.log, self.detail = state, name, total, clock, log, detail
        self.log_every, self.save_every, self.first = log_every, save_every, clock.first_step
        self.recent: list = list(state.running.get("recent", []))
        self.last: dict = dict(state.running.get("last", {}))

    def after(self, step: int, terms: dict[str, float]) -> None:
        """Step ``step`` (counted from 1) is done with loss ``terms``."""
        self.recent.append(terms)
        if step % self.log_every == 0 or step == self.total:
            self.last = mean_terms(self.recent)
            done = max(1, step - self.first)
            self.log(f"{self.name} {step}/{self.total}: " + ", ".join(f"{k} {v:.4f}" for k, v in self.last.items())
                     + self.detail() + f" ({self.clock.elapsed():.0f} s, {self.clock.elapsed() / done:.2f} s/step)")
            self.recent = []
        if step % self.save_every == 0:
            self.save(step)

    def save(self, step: int) -> None:
        self.state.save(step, running={"recent": self.recent, "last": self.last})

    def end(self, step: int) -> dict:
        """Save the state at the run's last step; the run's record: steps done in all and in this run, whether
        the schedule is over, wall seconds, seconds per step and the last logged losses (a run shorter than a
        log line: its own steps')."""
        self.save(step)
        done = step - self.first
        return {"steps_done": step, "steps_this_run": done, "finished": step >= self.total,
                "wall_s": round(self.clock.elapsed(), 1), "seconds_per_step": round(self.clock.elapsed() / max(1, done), 3),
                "last_losses": self.last or (mean_terms(self.recent) if self.recent else {})}


def warm_start(model: torch.nn.Module, checkpoint_state: dict[str, torch.Tensor], ema) -> None:
    """Start from committed weights: they become the model's weights and its EMA."""
    model.load_state_dict(checkpoint_state)
    ema.shadow = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def rewarm_factor(step: int, warm_started_at: Optional[int], steps: int = 50) -> float:
    """Scale of the learning rate after a warm start: a fresh optimiser ramps up over ``steps`` steps."""
    if warm_started_at is None:
        return 1.0
    return min(1.0, (step + 1 - warm_started_at) / steps)
