"""Which chunks' rows go into the next Euler step: the scheduling policy, apart from the mechanism that steps them.

The mechanism (``s3flow.engine.stepping``: one estimator call over the rows of any in-flight solves; the loop,
``s3flow.engine.step_loop``) lets every step carry a different set of chunks. This module only chooses the set,
from what it is told of each chunk in flight (a :class:`Candidate`, or anything with its fields: the step loop hands
it its flights) and a cost per step; it knows nothing of
tensors, Triton or how a step is run (as vLLM's scheduler sits beside its engine and workers). The served solver
and the simulator (``s3flow_tools.sim``, the step loop itself on a virtual clock) run the same :func:`pick`.

Policies:

* ``whole`` (the ``fifo`` scheduling: Triton's ``oldest`` batcher hands the solver a batch, solved whole): every
  chunk in flight, whatever the budget; with length bucketing (``bucket_ratio`` r >= 1) only the bucket of the
  shortest chunks (sorted by frames, a new bucket where a chunk is more than r times its bucket's shortest), so
  short rows do not pay for the padding of long ones and each bucket is solved whole before the next;
* ``deadline`` (least slack first): a chunk's *slack* is its stream's playback deadline (when a real-time player,
  started at the stream's first audio plus a start-up buffer, needs the next frame; for a START: its arrival plus
  a first-audio target; ``s3flow.engine.playback``) minus now minus the work the chunk has left
  (its steps x the cost of one of its steps). The least slack goes first: the stream closest to running dry;
* ``arrival``: oldest arrival first, a step at a time within the budget (the simulator's comparison).

Fewer steps (:func:`steps_in_time`): a chunk about to make its first step whose deadline comes before its full step
count can be made may be given fewer Euler steps (a cosine grid of its own, at least ``min_steps``), so that a late
stream gets slightly coarser frames rather than a gap; capacity and admission stay defined at full steps.

A step's rows are capped by a :class:`StepBudget` (estimator rows and rows x padded frames), so that a step, and
with it every stream's wait for its turn, stays about one step long whatever the load; a chunk that does not fit
waits for the next step (a smaller one behind it in the order may still fit).

Example::

    budget = StepBudget(max_rows=16, max_row_frames=16 * 400)
    chosen = pick(candidates, now, budget, cost=lambda rows, frames, past: 1e-3 + 2e-7 * rows * (frames + past / 10))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from s3flow.protocol import NumericSettings, check_numbers

#: the fewest Euler steps a late chunk may be given by default (results/fewer_steps.md: the quality they cost)
MIN_STEPS = 4
Policy = Literal["whole", "deadline", "arrival"]
POLICIES = ("whole", "deadline", "arrival")
#: seconds one step of ``rows`` estimator rows over ``frames`` padded frames, each reading ``past`` cached frames,
#: takes (a cost model)
StepCost = Callable[[int, int, int], float]


@dataclass(frozen=True)
class StepBudget:
    """The most one estimator call may carry: ``max_rows`` rows (guided chunks take 2) and ``max_row_frames``
    rows x padded frames (the call's size; it sets the step's time)."""
    max_rows: int = 32
    max_row_frames: int = 32 * 400

    def __post_init__(self):
        if self.max_rows < 1 or self.max_row_frames < 1:
            raise ValueError(f"a step budget needs max_rows >= 1 and max_row_frames >= 1, got {self}")


@dataclass
class DeadlineSettings(NumericSettings):
    """The streams' deadlines and what the deadline scheduling does to meet them (``cfm_solver`` parameters): the
    players the deadlines assume, a start-up buffer and a first-audio target (``s3flow.engine.playback``: the
    lead each answer reports, in either scheduling), and with ``scheduling: deadline`` the step budget and the
    fewest Euler steps a late chunk may be given (``min_steps``; 0: never fewer than its stream's)."""
    max_step_rows: int = 32
    max_step_row_frames: int = 32 * 400
    start_buffer_s: float = 0.3
    first_audio_s: float = 0.5
    min_steps: int = MIN_STEPS

    def check(self) -> None:
        check_numbers(self, "deadline setting", lowest={"start_buffer_s": 0, "first_audio_s": 0, "min_steps": 0})

    def budget(self) -> StepBudget:
        return StepBudget(self.max_step_rows, self.max_step_row_frames)


@dataclass
class Candidate:
    """A chunk in flight, as the policy sees it."""
    key: object            # whatever the caller identifies the chunk by
    arrival: float         # when it arrived (s)
    deadline: float        # when its stream needs its next frame (s, same clock)
    steps_left: int
    rows: int              # estimator rows of one of its steps (2 with guidance)
    frames: int            # its solve's frames
    past: int = 0          # frames of the prefix cache its rows read


def slack(c: Candidate, now: float, cost: StepCost) -> float:
    """Seconds to spare: deadline - now - the chunk's remaining work (its steps at its own step cost)."""
    return c.deadline - now - c.steps_left * cost(c.rows, c.frames, c.past)


def pick(candidates: Sequence[Candidate], now: float, budget: StepBudget, cost: StepCost,
         policy: Policy = "deadline", bucket_ratio: float = 0.0) -> list[Candidate]:
    """The candidates whose rows make the next step, in the policy's order, within ``budget`` (``whole``: every
    one, or its first bucket). Never empty when there are candidates: the first in order goes even when it alone
    exceeds the budget."""
    if policy == "whole":
        return first_bucket(candidates, bucket_ratio)
    if policy == "deadline":
        order = sorted(candidates, key=lambda c: (slack(c, now, cost), c.arrival))
    elif policy == "arrival":
        order = sorted(candidates, key=lambda c: c.arrival)
    else:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    chosen: list[Candidate] = []
    rows = frames = 0
    for c in order:
        r, f = rows + c.rows, max(frames, c.frames)
        if chosen and (r > budget.max_rows or r * f > budget.max_row_frames):
            continue
        chosen.append(c)
        rows, frames = r, f
    return chosen


def first_bucket(candidates: Sequence[Candidate], ratio: float) -> list[Candidate]:
    """All candidates (``ratio`` 0), or those of the shortest length bucket: by frames, up to ``ratio`` times the
    shortest (in arrival order)."""
    if not ratio or len(candidates) < 2:
        return list(candidates)
    shortest = min(c.frames for c in candidates)
    return [c for c in candidates if c.frames <= ratio * shortest]


def check_bucket_ratio(ratio: float, name: str = "bucket_ratio") -> None:
    """Length bucketing's ratio is 0 (off) or >= 1; ValueError naming ``name`` (the engine's argument, or the
    repository setting that becomes it) otherwise."""
    if ratio and ratio < 1:
        raise ValueError(f"{name} must be 0 (off) or >= 1, got {ratio}")


def steps_in_time(c: Candidate, now: float, step_s: float, min_steps: int) -> int:
    """The Euler steps a chunk not begun gets: all it has left when they meet its deadline at ``step_s`` seconds a
    step, else as many as do, but at least ``min_steps`` (0: all of them, always)."""
    if not min_steps or min_steps >= c.steps_left or c.deadline - now >= c.steps_left * step_s:
        return c.steps_left
    fit = int((c.deadline - now) // step_s) if step_s > 0 else c.steps_left
    return max(min_steps, min(c.steps_left, fit))
