"""The demand offered to a server: the share of its device that what it holds needs, and that what it refused asked.

A fleet must grow before its pods refuse, and go on growing while they do. ``s3flow_utilization`` is what a pod
holds; a pod that refuses holds less than its admission target by about one stream's price, and where that price
is large (a START priced by its start-up ramp on a small server) it held 0.54-0.59 while it refused eleven STARTs,
under the HPA's 0.7 (docs/reliability.md). So ``admission`` also publishes ``s3flow_demand``: the busiest stage's
utilization (admitted STARTs not yet held included) plus the price of every START it refused for room (over the
utilization target, or at the live cap) in the last ``window_s``, each correlation id once (a client that retries
the same id asks for one stream); that is what the HPA scales on (docker/k8s/hpa.yaml). A refused START is priced
as one stream once steady, one over its ensemble's capacity (``ServerLoad.capacity``, token2wav's ``wav_capacity``),
not at its start-up price (which admission weighs, 1.3-1.8x as much: a fleet sized by it would be too large).

The window is at least a scrape interval (Prometheus reads the gauge now and then; a refusal must be seen) and
short enough that a fleet that caught up stops growing: 15 s by default.

Example::

    refused = RefusedDemand()
    refused.note(corr_id=7, need=0.31)        # admission refused it for room
    demand = load.utilization(pending) + refused.total()
"""
from __future__ import annotations

import threading
import time
from typing import Callable

#: how long a refused START counts in the demand offered (seconds)
DEMAND_WINDOW_S = 15.0


class RefusedDemand:
    """The STARTs refused for room in the last ``window_s``, by correlation id: the latest price of each.
    Thread-safe (admission refuses on Triton's thread; the gauge is published from another)."""

    def __init__(self, window_s: float = DEMAND_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._lock = threading.Lock()
        self._refused: dict[int, tuple[float, float]] = {}   # id -> (when, price)

    def note(self, corr_id: int, need: float) -> None:
        """``corr_id``'s START was refused for room; it asked for ``need`` of the device."""
        with self._lock:
            self._refused[corr_id] = (self.clock(), max(need, 0.0))

    def admitted(self, corr_id: int) -> None:
        """``corr_id`` got in after all (a retry): it is held now, no longer turned away."""
        with self._lock:
            self._refused.pop(corr_id, None)

    def total(self) -> float:
        """The summed price of the STARTs refused in the last ``window_s``."""
        with self._lock:
            now = self.clock()
            self._refused = {c: (t, p) for c, (t, p) in self._refused.items() if now - t <= self.window_s}
            return sum(p for _, p in self._refused.values())
