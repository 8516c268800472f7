"""The idle reaper's thread (``s3flow.serving.reaper``): it evicts every period, and a wake runs a period at once
(a sequence dropped inside ``execute`` has its Triton slot freed now: a stop that came before the next period
waited Triton's whole 30 s exit timeout for it, tests/test_resume.py's teardown)."""
from __future__ import annotations

import threading
import time

from s3flow.serving.reaper import IdleReaper


def test_a_wake_runs_a_period_at_once_and_stop_ends_the_thread_without_waiting_a_period():
    ran = threading.Event()
    reaper = IdleReaper(lambda: [], idle_timeout_s=20.0, name="t", then=ran.set)   # a 5 s period
    try:
        assert not ran.wait(0.3), "nothing runs before its period"
        t0 = time.monotonic()
        reaper.wake()
        assert ran.wait(2.0) and time.monotonic() - t0 < 1.0, "a wake runs the period's work at once"
    finally:
        t0 = time.monotonic()
        reaper.stop()
    assert not reaper._thread.is_alive() and time.monotonic() - t0 < 1.0


def test_it_evicts_every_period_and_reports_what_it_evicted():
    evicted, reported = [[3], [], [4]], []
    reaper = IdleReaper(lambda: evicted.pop(0) if evicted else [], idle_timeout_s=0.2, name="t",
                        on_evicted=lambda: reported.append(1))
    try:
        t0 = time.monotonic()
        while evicted and time.monotonic() - t0 < 5:
            time.sleep(0.02)
    finally:
        reaper.stop()
    assert not evicted and reported == [1, 1], "reported after each period that evicted something"
