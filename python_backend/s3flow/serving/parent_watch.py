"""A python model's stub goes when its tritonserver dies, however it died.

The python backend's stub watches its server itself (``pb_stub.cc``: every 300 ms ``kill(parent_pid, 0)``), but
``kill(pid, 0)`` succeeds on a zombie: a tritonserver killed with SIGKILL (the OOM killer, a crash) whose own
parent has not reaped it yet (a supervisor, a test harness, a shell busy elsewhere) leaves every stub running,
orphaned, each holding its ~300 MB and its ``/dev/shm`` regions (seen: 5 of 5 still alive 30 s after the kill,
while the parent sat unreaped). Reparenting, unlike reaping, happens the moment the server exits, so a stub
whose parent PID is no longer the server's knows for certain.

The watch cannot live in the stub's own interpreter: a stub thread that calls into the dead server through the
python backend (a ``pb_utils.Metric`` set, a BLS call) waits for its answer forever *holding the GIL*, so no other
Python thread runs again (seen: the solver's stub alive 9 minutes after its server's SIGKILL, its metrics thread
in ``Metric::SendSetValueRequest``, a Python watch thread waiting for the GIL). :func:`watch_parent` therefore
starts a small ``/bin/sh`` loop beside the stub, its child: once a second it reads the stub's parent PID from
``/proc``; when that is no longer the server's it SIGKILLs the stub and ends; when the stub is gone (the loop is
reparented) it ends too, and a stub that exits normally kills it and its ``sleep`` on the way out (``atexit``).
What the server left in ``/dev/shm`` (its regions, the models' per-run folders) the next start sweeps
(``s3flow.server.leftovers.remove_stale``): nothing maps it any more.

The server watched is the one the python backend started the stub for, read from the stub's command line
(:func:`server_pid`), not the stub's parent when the watch starts: a server stopped while its stubs still load
(the solver's imports take seconds) has left by then, and a watch of the stub's new parent (PID 1) never acted
(seen: two solver stubs alive 18 minutes on, each in its initialize waiting on a metric call to the gone server).

Example::

    watch_parent()     # in a model's initialize: one line on stderr (the server's log file) when it acts
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from typing import Optional

import psutil

#: how often the watch looks (seconds; a stub outlives its server by at most about this)
PERIOD_S = 1.0

#: the watch: $1 the stub's PID, $2 the server's, $3 the period. Builtins only, but for sleep: ``read`` of
#: /proc/self/stat is the shell's own (a builtin's redirection opens the file in the shell itself)
WATCH = r'''
stub=$1 server=$2 period=$3
while :; do
    read -r me < /proc/self/stat || exit 0
    set -- ${me##*") "}
    [ "$2" = "$stub" ] || exit 0
    read -r it < /proc/$stub/stat || exit 0
    set -- ${it##*") "}
    if [ "$2" != "$server" ]; then
        echo "tritonserver (pid $server) is gone: its python stub (pid $stub) is killed" >&2
        kill -9 "$stub"
        exit 0
    fi
    sleep "$period"
done
'''

_watch: Optional[subprocess.Popen] = None   # the process's one watch
_lock = threading.Lock()


def server_pid(argv: Optional[list] = None) -> int:
    """The tritonserver this process serves: in a python backend stub (``argv``: default this process's), the
    parent PID the backend gave it (``triton_python_backend_stub <model.py> <shm region> <shm size> <shm growth>
    <server pid> ...``); elsewhere this process's parent."""
    argv = psutil.Process().cmdline() if argv is None else argv
    if len(argv) > 5 and argv[0].endswith("triton_python_backend_stub") and argv[5].isdigit():
        return int(argv[5])
    return os.getppid()


def watch_parent(period_s: float = PERIOD_S, parent: Optional[int] = None) -> subprocess.Popen:
    """Start the watch of this process's server (``parent``: its PID, default :func:`server_pid`), once per
    process (a stub is one process; a later call returns the first call's watch). A process whose parent is not
    that server when the watch starts is killed at its first look."""
    global _watch
    with _lock:
        if _watch is None or _watch.poll() is not None:
            server = server_pid() if parent is None else parent
            # a group of its own, so that a normal exit takes its sleep too (killpg)
            _watch = subprocess.Popen(["/bin/sh", "-c", WATCH, "s3flow-parent-watch", str(os.getpid()), str(server),
                                       f"{period_s:g}"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      start_new_session=True)
            atexit.register(_stop, _watch)
        return _watch


def _stop(watch: subprocess.Popen) -> None:
    try:
        os.killpg(watch.pid, signal.SIGKILL)
    except OSError:   # gone already
        pass
    watch.wait()
