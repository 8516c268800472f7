"""The step scheduler's policy (``s3flow.engine.scheduler``) and the playback clock it reads
(``s3flow.engine.playback``). Triton-free. The policy under load, on a virtual clock: tests/test_sim.py."""
from __future__ import annotations

import pytest

from s3flow.engine.playback import Playback, PlaybackSettings
from s3flow.engine.scheduler import Candidate, StepBudget, pick, slack, steps_in_time


def cost(rows: int, frames: int, past: int = 0) -> float:
    return 0.01 + 1e-5 * rows * (frames + 0.1 * past)


def cand(key, arrival, deadline, steps=10, rows=2, frames=100, past=0) -> Candidate:
    return Candidate(key, arrival, deadline, steps, rows, frames, past)


def test_a_chunk_reading_cached_keys_has_their_price_in_its_slack():
    """Issue 50 step 5: a chunk whose rows read a kept prompt is priced with those keys; of two chunks due at once
    with the same frames, the one reading 500 cached frames has less slack and goes first."""
    now = 100.0
    plain, cached = cand("plain", 1.0, 101.0), cand("cached", 2.0, 101.0, past=500)
    assert slack(plain, now, cost) - slack(cached, now, cost) == pytest.approx(10 * 2 * 1e-5 * 0.1 * 500)
    assert [c.key for c in pick([plain, cached], now, StepBudget(max_rows=2), cost)] == ["cached"]


def test_least_slack_goes_first_whatever_the_arrival_order():
    now = 100.0
    late = cand("late deadline", arrival=1.0, deadline=110.0)
    soon = cand("runs dry soon", arrival=5.0, deadline=101.0)
    long_work = cand("less time, more work", arrival=2.0, deadline=101.5, steps=10, frames=5000)
    assert slack(long_work, now, cost) < slack(soon, now, cost) < slack(late, now, cost)
    assert [c.key for c in pick([late, soon, long_work], now, StepBudget(64, 10**9), cost)] == \
        ["less time, more work", "runs dry soon", "late deadline"]
    assert [c.key for c in pick([late, soon, long_work], now, StepBudget(64, 10**9), cost, "arrival")] == \
        ["late deadline", "less time, more work", "runs dry soon"]


def test_a_step_keeps_within_its_budget_and_a_smaller_chunk_may_fill_it():
    now = 0.0
    cands = [cand("a", 0, 1.0, frames=300), cand("b", 0, 2.0, frames=300), cand("c", 0, 3.0, frames=600),
             cand("d", 0, 4.0, frames=100)]
    chosen = pick(cands, now, StepBudget(max_rows=6, max_row_frames=6 * 300), cost)
    assert [c.key for c in chosen] == ["a", "b", "d"], "c (600 frames) would make the call 2x wider"
    rows, frames = sum(c.rows for c in chosen), max(c.frames for c in chosen)
    assert rows <= 6 and rows * frames <= 6 * 300
    [alone] = pick([cand("huge", 0, 1.0, rows=2, frames=5000)], now, StepBudget(2, 100), cost)
    assert alone.key == "huge", "the most urgent chunk goes even when it alone exceeds the budget"
    assert pick([], now, StepBudget(), cost) == []
    with pytest.raises(ValueError, match="policy must be one of"):
        pick(cands, now, StepBudget(), cost, "lifo")
    with pytest.raises(ValueError, match="max_rows >= 1"):
        StepBudget(max_rows=0)


def test_the_playback_clock_gives_lead_and_deadline():
    settings = PlaybackSettings(start_buffer_s=0.3, first_audio_s=0.5)
    clock = Playback(arrived=10.0)
    assert clock.deadline(settings) == pytest.approx(10.5), "before its first answer: arrival + the first-audio target"
    assert clock.delivered(50, 10.2, settings).lead is None        # first answer: 1 s of audio
    assert clock.deadline(settings) == pytest.approx(10.2 + 0.3 + 1.0)
    assert clock.lead(10.7, settings) == pytest.approx(0.8)
    late = clock.delivered(25, 11.8, settings)                      # a player started at 10.5 ran dry at 11.5
    assert late.lead == pytest.approx(-0.3) and late.went_dry
    assert clock.deadline(settings) == pytest.approx(10.2 + 0.3 + 1.5)
    again = clock.delivered(25, 12.5, settings)                     # dry again: counted once
    assert again.lead == pytest.approx(-0.5) and not again.went_dry


def test_a_chunk_gets_fewer_steps_only_when_its_full_count_misses_its_deadline_and_never_below_min_steps():
    c = cand("a", arrival=0.0, deadline=1.0, steps=10)
    assert steps_in_time(c, now=0.0, step_s=0.1, min_steps=4) == 10, "10 steps of 0.1 s meet a deadline 1 s away"
    assert steps_in_time(c, now=0.0, step_s=0.125, min_steps=4) == 8, "8 of 0.125 s do"
    assert steps_in_time(c, now=0.5, step_s=0.125, min_steps=4) == 4, "4 do, just"
    assert steps_in_time(c, now=0.9, step_s=0.125, min_steps=4) == 4, "none would: still min_steps"
    assert steps_in_time(c, now=2.0, step_s=0.125, min_steps=4) == 4, "past its deadline: min_steps"
    assert steps_in_time(c, now=2.0, step_s=0.125, min_steps=0) == 10, "min_steps 0: never fewer"
    short = cand("b", arrival=0.0, deadline=0.0, steps=2)
    assert steps_in_time(short, now=1.0, step_s=0.1, min_steps=4) == 2, "fewer than min_steps to make: all of them"
