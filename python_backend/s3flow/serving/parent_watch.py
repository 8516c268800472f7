"""A python model's stub exits when its tritonserver dies, however it died.

The python backend's stub watches its server itself (``pb_stub.cc``: every 300 ms ``kill(parent_pid, 0)``), but
``kill(pid, 0)`` succeeds on a zombie: a tritonserver killed with SIGKILL (the OOM killer, a crash) whose own
parent has not reaped it yet (a supervisor, a test harness, a shell busy elsewhere) leaves every stub running,
orphaned, each holding its ~300 MB and its ``/dev/shm`` regions (seen: 5 of 5 still alive 30 s after the kill,
while the parent sat unreaped). Reparenting, unlike reaping, happens the moment the server exits, so a stub
whose parent PID is no longer the server's knows for certain.

:func:`watch_parent` is that check on a daemon thread: when the parent is gone it ends the process with
``os._exit``, skipping every clean-up that could wait on the dead server (the stub's own shutdown joins queues
the server no longer reads). What the server left in ``/dev/shm`` (its regions, the models' per-run folders) the
next start sweeps (``s3flow.server.leftovers.remove_stale``): nothing maps it any more.

Example::

    watch_parent()     # in a model's initialize: one line on stderr (the server's log file) when it exits
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Optional

#: how often the parent is looked at (a stub outlives its server by at most about this)
PERIOD_S = 0.5
#: the stub's exit status when its server went away
EXIT_CODE = 3

_watching: Optional[threading.Thread] = None   # the process's one watch
_lock = threading.Lock()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def watch_parent(log: Callable[[str], None] = _stderr, period_s: float = PERIOD_S,
                 exit: Callable[[int], None] = os._exit, parent: Optional[int] = None) -> threading.Thread:
    """Start the watch over the current parent (``parent``: its PID, default ``os.getppid()``), once per process
    (a stub is one process; a later call returns the first call's thread). ``log`` must not go through the server
    (``pb_utils.Logger`` does: to a dead process); ``exit`` ends the process."""
    global _watching
    with _lock:
        if _watching is not None:
            return _watching
    server_pid = os.getppid() if parent is None else parent

    def run() -> None:
        while True:
            threading.Event().wait(period_s)
            if os.getppid() != server_pid:
                break
        try:
            log(f"tritonserver (pid {server_pid}) is gone: this python stub (pid {os.getpid()}) exits")
        finally:
            exit(EXIT_CODE)

    with _lock:
        if _watching is None:
            _watching = threading.Thread(target=run, name="s3flow-parent-watch", daemon=True)
            _watching.start()
        return _watching
