"""Launch and stop a real ``tritonserver`` process (no Docker, no GPU needed).

Where the binary and its backends come from is :mod:`s3flow.server.install`; processes and ports
by number are :mod:`s3flow.server.processes`; both are re-exported here.

How the python models find their packages: the stub embeds the system ``libpython3.X`` and ignores
``PYTHONPATH``; the embedded interpreter looks ``python3`` up on ``PATH`` and uses the ``pyvenv.cfg`` next to
it. :class:`TritonServer` therefore puts ``<venv>/bin`` first on the server's ``PATH`` (the venv defaults to
the one running this code). The venv must be made by the same system Python (``/usr/bin/python3.11 -m venv``).
The alternative, per-model ``parameters: { key: "EXECUTION_ENV_PATH" value: { string_value: "/abs/venv" } }``,
works too (the backend runs ``source <venv>/bin/activate`` before the stub) but puts an absolute path in
``config.pbtxt``.

Example::

    from s3flow.server.triton_server import TritonServer

    with TritonServer("model_repository") as server:      # start() + wait_ready()
        client = server.client()                          # tritonclient.grpc.InferenceServerClient
        print(server.grpc_url, client.is_server_ready())
    # leaving the block stops the server (SIGTERM, then SIGKILL after the timeout), on SIGTERM to this program too
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from s3flow.server.access import ADMIN_KEY_ENV, ServerTls, admin_headers, restricted_api_flags, tenant_flags
from s3flow.server.drain import close
from s3flow.serving.draining import DRAIN_FILE_ENV
from s3flow.server.healing import StubWatch
from s3flow.server.leftovers import (DRAIN_PREFIX, new_drain_file, remove_drain_file, remove_server_files,
                                     remove_stale)
from s3flow.server.processes import (free_port, has_nvidia_gpu, is_running, kill, log_tail, port_open, read_cmdline,
                                      read_environ, stop_pid, tree_rss_bytes)
from s3flow.server.install import (TritonPaths, TritonServerError, check_venv, default_venv,
                                           find_tritonserver, prepare_backend_dir, venv_numpy_version,
                                           venv_python_version)

__all__ = [
    "TritonPaths",
    "TritonServer",
    "TritonServerError",
    "find_tritonserver",
    "free_port",
    "is_running",
    "prepare_backend_dir",
    "read_cmdline",
    "stop_pid",
    "tree_rss_bytes",
    "venv_numpy_version",
]

#: Model control modes accepted by ``--model-control-mode``.
MODEL_CONTROL_MODES = ("none", "explicit", "poll")

_PORT_IN_USE = re.compile(r"already in use|Address already in use|failed to start (GRPC|HTTP|Metrics)", re.I)

#: MALLOC_MMAP_THRESHOLD_ for the server and its stubs (see TritonServer.environment).
MMAP_THRESHOLD_BYTES = 1 << 20


class TritonServer:
    """One ``tritonserver`` process, started and stopped by PID.

    Args:
        model_repository: folder of models (``<name>/config.pbtxt``, ``<name>/1/model.py``).
        host: address all endpoints bind to.
        grpc_port, http_port, metrics_port: ports; a free one is chosen for each that is None
            (and re-chosen once if another process takes it before the server binds it).
        log_file: stdout+stderr of the server; defaults to ``server.log`` in a fresh temporary folder.
        model_control_mode: ``"none"`` (load everything at start), ``"explicit"`` (load/unload over the API;
            ``load_models`` are loaded at start) or ``"poll"``.
        load_models: models to load at start in ``explicit`` mode (``--load-model``).
        venv: the venv the python models run in (``<venv>/bin`` goes first on ``PATH``, and its Python
            version picks the stub); ``"auto"`` = the venv running this code, None = leave ``PATH`` alone.
        extra_args: more server flags, e.g. ``["--log-verbose=1"]``.
        env: extra environment variables for the server.
        paths: a :class:`TritonPaths`; default :func:`find_tritonserver`.
        shm_byte_size: python-backend shared memory per model instance at start (``shm-default-byte-size``).
        drain_s: run the server under ``s3flow.server.drain supervise``: SIGTERM (``stop``) first drains (new
            sequences refused, those in flight finish) for up to this many seconds; None: plain tritonserver.
        admin_key: every API category a streaming client does not need answers only calls that carry
            this key (:mod:`s3flow.server.access`); None: all open.
        tls: gRPC over TLS (:class:`s3flow.server.access.ServerTls`); readiness is then probed over HTTP.
        tenants: forward the tenant header to the models (voices per tenant; only behind an entry that sets
            the header itself, docs/security.md).
        heal: reload the model of a python stub that dies (:mod:`s3flow.server.healing`; Triton does not restart
            it); implies explicit model control with every model loaded at start. Supervised (``drain_s``), the
            supervisor heals, as the shipped entrypoint's does; else this launcher (:attr:`healer`).
        background_stop: leaving the ``with`` block starts the stop and returns at once; a thread of this program
            finishes it (:func:`wait_background_stops`), and the program does not exit before it has. A stop takes
            2-3 s that are Triton's own (its python backend sleeps 1 s per stub before finalizing it, and the server
            looks at its models once a second): a test suite starts its next server meanwhile.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike,
        host: str = "127.0.0.1",
        grpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        log_file: str | os.PathLike | None = None,
        model_control_mode: str = "none",
        load_models: Sequence[str] = (),
        venv: str | os.PathLike | None = "auto",
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        paths: TritonPaths | None = None,
        shm_byte_size: int | None = None,
        drain_s: float | None = None,
        admin_key: str | None = None,
        tls: ServerTls | None = None,
        tenants: bool = False,
        heal: bool = False,
        background_stop: bool = False,
    ) -> None:
        if heal:   # the repository API's load is what heals (s3flow.server.healing)
            model_control_mode, load_models = "explicit", list(load_models) or ["*"]
        if model_control_mode not in MODEL_CONTROL_MODES:
            raise ValueError(f"model_control_mode must be one of {MODEL_CONTROL_MODES}, got {model_control_mode!r}")
        if load_models and model_control_mode != "explicit":
            raise ValueError(f"load_models needs model_control_mode='explicit', got {model_control_mode!r}")
        self.model_repository = pathlib.Path(model_repository).absolute()
        if not self.model_repository.is_dir():
            raise TritonServerError(f"model repository not found: {self.model_repository}")
        self.host = host
        self._fixed_ports = {"grpc": grpc_port, "http": http_port, "metrics": metrics_port}
        self.grpc_port, self.http_port, self.metrics_port = grpc_port, http_port, metrics_port
        self.log_file = pathlib.Path(log_file).absolute() if log_file is not None else None
        self.model_control_mode = model_control_mode
        self.load_models = list(load_models)
        self.venv = default_venv() if venv == "auto" else (pathlib.Path(venv).absolute() if venv else None)
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.paths = paths or find_tritonserver()
        self.shm_byte_size = shm_byte_size
        self.drain_s = drain_s
        self.admin_key = admin_key
        self.tls = tls
        self.access_flags = (restricted_api_flags(admin_key) if admin_key is not None else []) + \
            (tls.flags() if tls is not None else []) + (tenant_flags() if tenants else [])
        # supervised (drain_s): the supervisor drains and closes on SIGTERM; else stop() closes before SIGTERM
        self.drain_file = new_drain_file()   # (its folder: made at start, gone at stop; a dead launcher's, swept)
        self.shm_prefix = f"s3flow_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.process: subprocess.Popen | None = None
        self._log_handle = None
        self._port_retries = 2
        self.heal = heal
        self.healer: StubWatch | None = None
        self.background_stop = background_stop

    # ----------------------------------------------------------------------------------------- endpoints
    @property
    def grpc_url(self) -> str:
        """``host:port`` for ``tritonclient.grpc.InferenceServerClient``."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def client(self, **kwargs: Any):
        """A new ``tritonclient.grpc.InferenceServerClient`` for this server."""
        import tritonclient.grpc as grpcclient

        return grpcclient.InferenceServerClient(self.grpc_url, **kwargs)

    def _ready_now(self) -> bool:
        """One live+ready probe: over gRPC, or over HTTP when gRPC needs TLS (health is open on both)."""
        from tritonclient.utils import InferenceServerException

        if self.tls is None:
            client, kwargs = self.client(), {"client_timeout": 2.0}
        else:
            import tritonclient.http as httpclient

            client, kwargs = httpclient.InferenceServerClient(self.http_url, connection_timeout=2.0,
                                                              network_timeout=2.0), {}
        try:
            return client.is_server_live(**kwargs) and client.is_server_ready(**kwargs)
        except (InferenceServerException, OSError):
            return False
        finally:
            client.close()

    # ----------------------------------------------------------------------------------------- command
    def command(self) -> list[str]:
        """The full command line (ports must be chosen, see :meth:`start`)."""
        backend_dir = prepare_backend_dir(self.paths, self._python_version())
        cmd = [
            str(self.paths.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            "--disable-auto-complete-config",
            "--exit-on-error=true",
            f"--model-control-mode={self.model_control_mode}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if self.shm_byte_size is not None:
            cmd.append(f"--backend-config=python,shm-default-byte-size={self.shm_byte_size}")
        if not has_nvidia_gpu():
            cmd.append("--allow-gpu-metrics=false")  # otherwise: "Error: Failed to initialize NVML" in the log
        cmd += [f"--load-model={name}" for name in self.load_models]
        cmd += self.access_flags
        cmd += self.extra_args
        if self.drain_s is None:
            return cmd
        python = str(self.venv / "bin" / "python3") if self.venv is not None else sys.executable
        heal = [f"--heal-http-url=http://{self.http_url}"] if self.heal else []   # the supervisor heals, as shipped
        return [python, "-m", "s3flow.server.drain", "supervise", f"--deadline-s={self.drain_s}",
                f"--drain-file={self.drain_file}",
                f"--metrics-url=http://{self.host}:{self.metrics_port}/metrics", *heal, "--"] + cmd

    @property
    def draining(self) -> bool:
        """A drain has started (the supervisor made the drain file)."""
        return self.drain_s is not None and self.drain_file.exists()

    def environment(self) -> dict[str, str]:
        """The server's environment: ours, plus the wheel libs on ``LD_LIBRARY_PATH`` and the venv on ``PATH``."""
        env = dict(os.environ)
        env.pop("PYTHONHOME", None)  # would point the embedded interpreter at the wrong stdlib
        if self.paths.lib_dirs:
            libs = [str(p) for p in self.paths.lib_dirs]
            env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
        if self.venv is not None:
            env["PATH"] = os.pathsep.join([str(self.venv / "bin"), env.get("PATH", "/usr/bin:/bin")])
            env["VIRTUAL_ENV"] = str(self.venv)
        # allocations of 1 MiB and more are mapped and unmapped one by one, so memory a long utterance
        # needed goes back to the system (glibc's default threshold climbs, and the heap keeps it)
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES))
        if self.drain_s is None:   # (the supervisor sets it for its child)
            env[DRAIN_FILE_ENV] = str(self.drain_file)
        elif self.heal and self.admin_key is not None:   # the supervisor heals over the restricted repository API
            env[ADMIN_KEY_ENV] = self.admin_key
        env.update(self.extra_env)
        return env

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process under it (the python-backend stubs)."""
        return tree_rss_bytes(self.pid) if self.pid is not None else 0

    def _python_version(self) -> str | None:
        return venv_python_version(self.venv) if self.venv is not None else None

    # ----------------------------------------------------------------------------------------- lifecycle
    def start(self) -> TritonServer:
        """Launch the server in its own session and return at once (see :meth:`wait_ready`)."""
        if self.process is not None and self.process.poll() is None:
            raise TritonServerError(f"server already running (pid {self.process.pid})")
        self.healer = None   # a new process: its stubs are watched once it is ready
        if self.venv is not None:
            check_venv(self.venv)
        remove_stale()   # what servers long gone left in /dev/shm and the temp folder
        self.drain_file.parent.mkdir(mode=0o700, exist_ok=True)
        chosen: set[int] = {p for p in self._fixed_ports.values() if p is not None}
        for name, fixed in self._fixed_ports.items():
            port = fixed
            while port is None or (fixed is None and port in chosen):  # the OS may hand out one port twice
                port = free_port(self.host)
            chosen.add(port)
            setattr(self, f"{name}_port", port)
        if self.log_file is None:
            self.log_file = pathlib.Path(tempfile.mkdtemp(prefix="tritonserver-")) / "server.log"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        self._close_log()
        self._log_handle = open(self.log_file, "ab")
        shown = [a.replace(self.admin_key, "<admin key>") if self.admin_key else a for a in cmd]
        self._log_handle.write(("$ " + " ".join(shown) + "\n").encode())
        self._log_handle.flush()
        self._log_start = self._log_handle.tell()
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Poll live+ready until both hold; return the seconds waited.

        Raises:
            TritonServerError: the process exited (with its exit code and log tail), or ``timeout`` passed
                (the server is stopped first).
        """
        if self.process is None:
            raise TritonServerError("server not started")
        start = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                if self._retry_on_port_clash():
                    continue
                raise TritonServerError(
                    f"tritonserver exited with code {code} before it was ready "
                    f"(log {self.log_file}):\n{log_tail(self.log_file)}"
                )
            # A gRPC channel that failed to connect backs off for seconds before it retries, so wait for
            # the port to accept TCP first and use a fresh client for each probe.
            if port_open(self.host, self.grpc_port) and port_open(self.host, self.http_port):
                if self._ready_now():
                    self._wait_metrics_port(start + timeout)
                    if self.heal and self.drain_s is None and self.healer is None:   # (supervised: it heals)
                        self.healer = StubWatch(self.pid, self.http_url,
                                                headers=admin_headers(self.admin_key, "http")).start()
                    return time.monotonic() - start
            if time.monotonic() - start > timeout:
                self.stop()
                raise TritonServerError(
                    f"tritonserver not ready after {timeout:.0f} s (log {self.log_file}):\n"
                    f"{log_tail(self.log_file)}"
                )
            time.sleep(0.1)

    def _wait_metrics_port(self, until: float) -> None:
        """Triton opens its metrics port a moment after it reports ready: wait for it (bounded)."""
        if "--allow-metrics=false" in self.extra_args:
            return
        while not port_open(self.host, self.metrics_port) and time.monotonic() < until:
            time.sleep(0.05)

    def _retry_on_port_clash(self) -> bool:
        """Restart with new ports if another process took an auto-chosen port first."""
        if self._port_retries <= 0 or all(p is not None for p in self._fixed_ports.values()):
            return False
        with open(self.log_file, "rb") as f:
            f.seek(self._log_start)
            if not _PORT_IN_USE.search(f.read().decode(errors="replace")):
                return False
        self._port_retries -= 1
        self.start()
        return True

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process we started, wait ``timeout`` s, then SIGKILL its process group.

        Unsupervised, the python models first drop what they hold and free Triton's sequence slots
        (``s3flow.server.drain.close``), so that the shutdown has no open sequence to wait for. Returns the exit
        code (None if never started). Also removes this server's files from ``/dev/shm`` (its folders, and the
        python-backend regions a kill left behind) and its drain marker's folder from the temp folder.
        """
        if self.process is None:
            return None
        if self.healer is not None:   # the stubs go now: none of them may be reloaded
            self.healer.stop()
        if self.process.poll() is None:
            if self.drain_s is None and self.metrics_port is not None:   # free every sequence slot first
                close(str(self.drain_file), f"{self.host}:{self.metrics_port}", log=lambda _: None)
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout + (self.drain_s or 0.0))
            except subprocess.TimeoutExpired:
                kill(self.process.pid, kill_group=True)
                self.process.wait(10)
        self._close_log()
        self._remove_files()
        return self.process.returncode

    def _remove_files(self) -> None:
        """This server's folders, its drain marker's, and any python-backend region or environment folder a kill
        left (``s3flow.server.leftovers``)."""
        remove_server_files(self.process.pid)
        remove_drain_file(self.drain_file)
        if self.process.returncode is not None and self.process.returncode < 0:   # killed: no backend cleaned up
            remove_stale()
        for leftover in pathlib.Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            try:
                leftover.unlink()
            except OSError:
                pass


    def _close_log(self) -> None:
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def log_tail(self, lines: int = 40) -> str:
        """The last meaningful lines of the server log."""
        return log_tail(self.log_file, lines)

    def __enter__(self) -> TritonServer:
        _leave_on_sigterm()
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.background_stop:
            self.stop_in_background()
        else:
            self.stop()

    def stop_in_background(self, timeout: float = 30.0) -> threading.Thread:
        """:meth:`stop` in a thread that is not a daemon (the program waits for it before it exits); returns it.
        :func:`wait_background_stops` joins every such stop."""
        thread = threading.Thread(target=self.stop, args=(timeout,), name=f"stop tritonserver {self.pid}")
        with _STOPPING_LOCK:
            _STOPPING.append((self, thread))
        thread.start()
        return thread

    def __repr__(self) -> str:
        return f"TritonServer(pid={self.pid}, grpc={self.grpc_url}, repository={self.model_repository})"


_STOPPING: list[tuple[TritonServer, threading.Thread]] = []
_STOPPING_LOCK = threading.Lock()


def wait_background_stops(timeout: float = 60.0) -> list[TritonServer]:
    """Join the stops :meth:`TritonServer.stop_in_background` started; returns those servers (each one's
    ``process.returncode`` says how it ended). A stop still running after ``timeout`` s raises."""
    with _STOPPING_LOCK:
        stopping, _STOPPING[:] = list(_STOPPING), []
    until = time.monotonic() + timeout
    for server, thread in stopping:
        thread.join(max(0.0, until - time.monotonic()))
        if thread.is_alive():
            raise TritonServerError(f"tritonserver {server.pid} still stopping after {timeout:.0f} s")
    return [server for server, _ in stopping]


def _leave_on_sigterm() -> None:
    """A program that runs a server in a ``with`` block and is sent SIGTERM (``kill PID``, a job runner's stop)
    leaves the block as on Ctrl-C, so the server stops with it: Python's default ends the program at once, and the
    server, in a session of its own, ran on (seen when a measurement driver was stopped by its PID). Set from the
    main thread only, and only where the program has no SIGTERM handler of its own.

    The kernel may hand the signal to any thread (gRPC's, for one); Python then only marks it for the main thread,
    which runs the handler when it next runs Python code: a main thread asleep in ``time.sleep(300)`` slept on
    (1 stop in about 15). So the handler also wakes the main thread: Python writes each signal's number to a
    wakeup socket, and a daemon thread that reads a SIGTERM there sends it once more to the main thread itself,
    whose sleep then ends. Skipped where the program has a wakeup fd of its own (asyncio)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    reader, writer = socket.socketpair()   # (both open for the program's life: the wakeup fd is the writer)
    writer.setblocking(False)
    theirs = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if theirs != -1:   # the program's own: give it back
        signal.set_wakeup_fd(theirs)
        reader.close()
        writer.close()
        return
    _WAKEUP.append((reader, writer))
    threading.Thread(target=_wake_main_on_sigterm, args=(reader, threading.main_thread().ident), daemon=True,
                     name="wake the main thread on SIGTERM").start()


def _wake_main_on_sigterm(reader: socket.socket, main: int) -> None:
    woken = False
    while True:   # (drains the socket for good: every signal Python handles writes its number there)
        if signal.SIGTERM in reader.recv(64) and not woken:
            woken = True
            signal.pthread_kill(main, signal.SIGTERM)


_WAKEUP: list[tuple[socket.socket, socket.socket]] = []
_LEAVING = threading.Event()


def _exit_on_sigterm(signum, frame) -> None:
    if not _LEAVING.is_set():   # once: the wake-up's own SIGTERM must not interrupt the stop it started
        _LEAVING.set()
        raise SystemExit(128 + signum)


def stop_server_pid(pid: int, timeout: float = 30.0) -> bool:
    """Stop a tritonserver by PID that this process did not start (``scripts/server.py stop``), as
    :meth:`TritonServer.stop` does: its models drop what they hold and free the sequence slots first (its drain
    file and metrics port read from its environment and command line), then SIGTERM, SIGKILL after ``timeout``;
    then its ``/dev/shm`` folders and its drain marker's folder go. True if it exited on SIGTERM."""
    argv, drain_file = read_cmdline(pid) or [], read_environ(pid).get(DRAIN_FILE_ENV, "")
    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    if drain_file and "metrics-port" in flags:
        close(drain_file, f"{flags.get('metrics-address', '127.0.0.1')}:{flags['metrics-port']}", log=lambda _: None)
    graceful = stop_pid(pid, timeout=timeout)
    remove_server_files(pid)
    if drain_file and pathlib.Path(drain_file).parent.name.startswith(DRAIN_PREFIX):   # (a TritonServer's own)
        remove_drain_file(pathlib.Path(drain_file))
    return graceful
