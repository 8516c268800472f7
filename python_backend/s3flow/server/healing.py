"""A server whose python stub died heals: its launcher reloads that model (issue 53).

Each python model instance runs in a stub process of its own, and a host short of memory kills the largest
process it finds, often one of ours. Triton 2.51's python backend does not restart a dead stub (the restart path
went with python_backend's unification of the decoupled and the plain paths, mid-2024; server issues 7862 and
8604), and it still answers ready, server and model alike, while every request to the model fails "Stub process
'estimator_0_0' is not healthy". What does bring it back is a reload over the repository API (explicit model
control): measured here 1.1-1.4 s for the estimator and for the solver, after which a new utterance is served.
Where the repository API is behind the admin key (``s3flow.server.access``), so that no client can load or
unload a model, the watch presents the key.

:class:`StubWatch` runs in the launcher (``TritonServer(heal=True)``): once the server is ready it learns its
stubs (each stub's command line names its ``<model>/1/model.py``) and every ``interval_s`` looks again; the model
of a stub that is gone is reloaded (``POST /v2/repository/models/<model>/load``). A stateful model comes back
empty: the streams its dead instance held are gone, and their clients resume them from their last snapshot. While
a model is being reloaded :attr:`StubWatch.healing` names it, and its ``marker`` file stands (the readiness probe,
``s3flow.server.drain.ready``, answers not ready meanwhile). A reload that fails is tried again at every look, the
marker standing all the while, so that the liveness probe (``s3flow.server.drain.live``) fails once the marker is
older than its bound and Kubernetes restarts the pod. A reload reloads every instance of the model.

Known cost: Triton never finishes unloading the dead instance, so a healed server's SIGTERM waits for its exit
timeout (30 s here) before it exits.

Example::

    with TritonServer(repo, heal=True) as server:   # explicit model control, every model loaded at start
        ...                                          # a stub killed: its model is reloaded within seconds
        server.healer.heals                          # [(model, seconds the reload took), ...]
"""
from __future__ import annotations

import pathlib
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Optional

from s3flow.server.processes import read_cmdline, tree_pids

#: the python backend's stub program
STUB = "triton_python_backend_stub"


def stubs(server_pid: int) -> dict[int, str]:
    """pid -> model of each python stub of the server (from the stub's command line: its ``model.py`` path)."""
    out = {}
    for pid in tree_pids(server_pid):
        cmd = read_cmdline(pid) or []
        if len(cmd) > 1 and cmd[0].endswith(STUB):
            out[pid] = pathlib.Path(cmd[1]).parents[1].name
    return out


class StubWatch:
    """Reloads the model of each stub of ``server_pid`` that dies (module docstring)."""

    def __init__(self, server_pid: int, http_url: str, interval_s: float = 0.5, reload_timeout_s: float = 120.0,
                 log: Callable[[str], None] = print, headers: Optional[dict] = None,
                 marker: Optional[pathlib.Path] = None):
        """``headers``: for the repository API (the admin key where the server restricts it,
        ``s3flow.server.access.admin_headers(key, "http")``); ``marker``: a file that stands while a model is
        reloaded (the readiness probe, ``s3flow.server.drain.ready``, says not ready while it does)."""
        self.server_pid, self.interval_s, self.headers = server_pid, interval_s, dict(headers or {})
        self.marker = marker
        self.http_url = http_url.rstrip("/").removeprefix("http://")
        self.reload_timeout_s, self.log = reload_timeout_s, log
        self.healing: set[str] = set()
        self.failed: set[str] = set()   # models whose reload failed (tried again every ``interval_s``)
        self.heals: list[tuple[str, float]] = []
        self._known: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="s3flow-stub-watch", daemon=True)

    def start(self) -> "StubWatch":
        self._known = stubs(self.server_pid)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more reloads (call before the server is stopped: its stubs go then, and must not be reloaded)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.reload_timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = stubs(self.server_pid)
            dead = sorted({model for pid, model in self._known.items() if pid not in now} | self.failed)
            if dead and self.marker is not None and not self.marker.exists():   # its age: since the first death
                self.marker.write_text(" ".join(dead))
            for model in dead:
                if self._stop.is_set():
                    return
                if self.heal(model):
                    self.failed.discard(model)
                else:   # tried again at the next look; readiness stays false, liveness fails past its bound
                    self.failed.add(model)
            self._known = stubs(self.server_pid) if dead else now
            if dead and not self.failed and self.marker is not None:
                self.marker.unlink(missing_ok=True)

    def heal(self, model: str) -> bool:
        """Reload ``model`` over the repository API; whether Triton said it is loaded."""
        self.healing.add(model)
        t0 = time.monotonic()
        self.log(f"a python stub of model '{model}' died: reloading it")
        request = urllib.request.Request(f"http://{self.http_url}/v2/repository/models/{model}/load", data=b"{}",
                                         method="POST", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.reload_timeout_s) as response:
                ok = response.status == 200
        except (OSError, urllib.error.URLError) as exc:
            self.log(f"reloading '{model}' failed: {exc}")
            ok = False
        finally:
            self.healing.discard(model)
        if ok:
            self.heals.append((model, time.monotonic() - t0))
            self.log(f"model '{model}' reloaded in {time.monotonic() - t0:.1f} s")
        return ok
