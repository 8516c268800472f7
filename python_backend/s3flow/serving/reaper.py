"""The idle reaper of a stateful python model: a thread that evicts idle sequences when no request comes.

Triton drops an idle sequence without telling the model, and the model's own ``evict_idle`` runs only when
something calls it: a model whose clients all went would hold their states until its next request. Both
stateful models (``cfm_solver``, ``vocoder``) run one :class:`IdleReaper` per instance (``SequenceTable`` has
its own lock and never evicts a sequence being served, so the thread is safe beside ``execute``).

Example::

    reaper = IdleReaper(table.evict_idle, idle_timeout_s=5.0, name="vocoder", on_evicted=publish_live)
    ...
    reaper.stop()      # finalize()
"""
from __future__ import annotations

import threading
from typing import Callable, Optional


class IdleReaper:
    def __init__(self, evict: Callable[[], list], idle_timeout_s: float, name: str,
                 on_evicted: Optional[Callable[[], None]] = None, then: Optional[Callable[[], object]] = None,
                 log: Callable[[str], None] = lambda _: None):
        """Calls ``evict()`` (returning the evicted ids) every quarter of ``idle_timeout_s`` (between 50 ms and
        5 s), then ``on_evicted()`` when it evicted any, then ``then()`` (the model's ``SlotRelease.send``: what
        must not run inside ``execute``)."""
        self.evict, self.on_evicted, self.then, self.log = evict, on_evicted, then, log
        self.name = name
        self.period_s = min(max(idle_timeout_s / 4, 0.05), 5.0)
        self._stop, self._kick = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-idle-reaper", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Run a period now (any thread): a sequence dropped inside ``execute`` has its slot freed at once, not a
        period later (a stop that came in between waited Triton's whole 30 s exit timeout for it)."""
        self._kick.set()

    def _run(self) -> None:
        while True:
            self._kick.wait(self.period_s)
            self._kick.clear()
            if self._stop.is_set():
                return
            try:
                if self.evict() and self.on_evicted is not None:
                    self.on_evicted()
                if self.then is not None:
                    self.then()
            except Exception as exc:  # a bug here must not stop the reaping for good
                self.log(f"{self.name}: idle reaper: {type(exc).__name__}: {exc}")

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._kick.set()
        self._thread.join(timeout_s)
