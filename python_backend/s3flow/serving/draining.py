"""The drain file: how a server that is going away tells its python models (``s3flow.server.drain`` writes it).

While the file named by ``S3FLOW_DRAIN_FILE`` (in the server's environment) exists, the server is *draining*:
the solver answers every START with a ``resume`` disposition (send it to another server) and goes on serving
the sequences it holds. When the file says ``closing`` (the drain is over, or there was none: a plain stop), the
stateful models drop every sequence they still hold and give Triton its slot back
(``s3flow.serving.triton_models.slots``): Triton's shutdown waits for every open sequence slot, and after
SIGTERM it takes no more requests, so the slots must be freed before it.
"""
from __future__ import annotations

import os
import pathlib
import time
from typing import Callable, Optional

from s3flow.serving.records import write_atomic

DRAIN_FILE_ENV = "S3FLOW_DRAIN_FILE"
#: how often a model looks at the drain file at most to see whether the server closes (seconds): asked per request
#: and by the reaper, whose period is longer, and ``close`` waits for the live gauges. Whether it drains is asked at
#: STARTs only, each afresh: a START right after the drain began must hear ``resume`` (tests/test_refusals.py)
CLOSING_EVERY_S = 0.5
_DRAINING, _CLOSING = "draining", "closing"


def _path(path: Optional[str]) -> str:
    return path if path is not None else os.environ.get(DRAIN_FILE_ENV, "")


def draining_probe(path: Optional[str] = None) -> Callable[[], bool]:
    """For the solver and admission: a function telling whether this server is draining (its drain file exists)."""
    path = _path(path)
    if not path:
        return lambda: False
    return lambda: os.path.exists(path)


def closing_probe(path: Optional[str] = None, every_s: float = CLOSING_EVERY_S) -> Callable[[], bool]:
    """For the stateful models: a function telling whether the server is closing (drop everything held), looking
    at the file at most every ``every_s``."""
    path = _path(path)
    if not path:
        return lambda: False

    def closing() -> bool:
        try:
            return pathlib.Path(path).read_text().startswith(_CLOSING)
        except OSError:
            return False
    return _every(closing, every_s)


def _every(probe: Callable[[], bool], every_s: float) -> Callable[[], bool]:
    """``probe`` asked at most every ``every_s`` (its last answer in between): the models asked it per request,
    a file system call each (results/syscalls.md); the supervisor waits longer than that after marking it."""
    last = [float("-inf"), False]

    def cached() -> bool:
        now = time.monotonic()
        if now - last[0] >= every_s:
            last[:] = [now, probe()]
        return last[1]
    return cached


def mark_draining(path: str) -> None:
    """Start a drain: new sequences are refused from now on."""
    _write(path, _DRAINING)


def mark_closing(path: str) -> None:
    """End it: the models drop what they hold and free its slots (new sequences are still refused)."""
    _write(path, _CLOSING)


def _write(path: str, phase: str) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(p, f"{phase} since {time.time():.3f}\n")
