"""The drain file: how a server that is going away tells its python models (``s3flow.server.drain`` writes it).

While the file named by ``S3FLOW_DRAIN_FILE`` (in the server's environment) exists, the server is *draining*:
the solver answers every START with a ``resume`` disposition (send it to another server) and goes on serving
the sequences it holds. When the file says ``closing`` (the drain is over, or there was none: a plain stop), the
stateful models drop every sequence they still hold and give Triton its slot back
(``s3flow.serving.triton_models.slots``): Triton's shutdown waits for every open sequence slot, and after
SIGTERM it takes no more requests, so the slots must be freed before it.
"""
from __future__ import annotations

import ctypes
import os
import pathlib
import struct
import threading
import time
from typing import Callable, Optional

from s3flow.serving.records import write_atomic

DRAIN_FILE_ENV = "S3FLOW_DRAIN_FILE"
#: where the kernel cannot watch the drain file's folder (``FolderWatch``), how often a model looks at the file at
#: most to see whether the server closes (seconds): asked per request and by the reaper, whose period is longer, and
#: ``close`` waits for the live gauges. Whether it drains is asked at STARTs only, each afresh: a START right after
#: the drain began must hear ``resume`` (tests/test_refusals.py)
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
    """For the stateful models: a function telling whether the server is closing (drop everything held). The file
    is looked at once, then each time its folder changes (:class:`FolderWatch`: no system call between changes,
    and a mark is seen within moments); where the kernel cannot watch it, at most every ``every_s``."""
    path = _path(path)
    if not path:
        return lambda: False

    def closing() -> bool:
        try:
            return pathlib.Path(path).read_text().startswith(_CLOSING)
        except OSError:
            return False
    try:
        return FolderWatch(path, closing)
    except OSError:
        return _every(closing, every_s)


class FolderWatch:
    """``look()``'s answer, kept current by the kernel: looked at once, then again whenever a file named like
    ``path`` in its folder is written, moved or removed (Linux inotify, read by a daemon thread that sleeps in
    ``read`` between changes). Calling it returns the answer: memory only. OSError where inotify is not there."""

    #: IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE
    _MASK = 0x2 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200
    _OVERFLOW = 0x4000
    _EVENT = struct.Struct("iIII")   # wd, mask, cookie, name length

    def __init__(self, path: str, look: Callable[[], bool]):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init, add = libc.inotify_init1, libc.inotify_add_watch
        except (OSError, AttributeError) as exc:
            raise OSError(f"no inotify: {exc}") from exc
        folder, self.name = os.path.split(os.path.abspath(path))
        self.fd = init(os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if add(self.fd, os.fsencode(folder), self._MASK) < 0:   # watched before the first look: no change is missed
            errno = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(errno, f"inotify_add_watch {folder}")
        self.look, self.answer = look, look()
        threading.Thread(target=self._run, name="drain-watch", daemon=True).start()

    def __call__(self) -> bool:
        return self.answer

    def _run(self) -> None:
        name = os.fsencode(self.name)
        while True:
            try:
                data = os.read(self.fd, 4096)
            except OSError:
                return
            at, changed = 0, False
            while at + self._EVENT.size <= len(data):
                _, mask, _, length = self._EVENT.unpack_from(data, at)
                event = data[at + self._EVENT.size:at + self._EVENT.size + length].rstrip(b"\0")
                changed |= event == name or bool(mask & self._OVERFLOW)
                at += self._EVENT.size + length
            if changed:
                self.answer = self.look()


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
