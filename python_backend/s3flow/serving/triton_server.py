"""Launch and stop a real ``tritonserver`` process (no Docker, no GPU needed).

Two ways to get a server binary are supported:

* **The nvidia-pytriton wheel** (the default on a plain host): the wheel ships ``tritonserver``, its shared
  libraries (``site-packages/nvidia_pytriton.libs``), the python backend and one python-backend stub per
  Python version (``pytriton/tritonserver/python_backend_stubs/<X.Y>/``). The stub is *not* inside the
  backend folder, so :func:`prepare_backend_dir` builds a small backend folder (symlinks, kept in a cache
  folder) whose ``python/`` holds the stub for the Python version of the model venv.
* **An NGC container / own build**: set ``TRITONSERVER`` (path or name on ``PATH``) or pass ``binary=``;
  backends default to ``/opt/tritonserver/backends`` (override with ``TRITONSERVER_BACKEND_DIR``).

How the python models find their packages: the stub embeds the system ``libpython3.X`` and ignores
``PYTHONPATH``; the embedded interpreter looks ``python3`` up on ``PATH`` and uses the ``pyvenv.cfg`` next to
it. :class:`TritonServer` therefore puts ``<venv>/bin`` first on the server's ``PATH`` (the venv defaults to
the one running this code). The venv must be made by the same system Python (``/usr/bin/python3.11 -m venv``).
The alternative, per-model ``parameters: { key: "EXECUTION_ENV_PATH" value: { string_value: "/abs/venv" } }``,
works too (the backend runs ``source <venv>/bin/activate`` before the stub) but puts an absolute path in
``config.pbtxt``.

Example::

    from s3flow.serving.triton_server import TritonServer

    with TritonServer("model_repository") as server:      # start() + wait_ready()
        client = server.client()                          # tritonclient.grpc.InferenceServerClient
        print(server.grpc_url, client.is_server_ready())
    # leaving the block stops the server (SIGTERM, then SIGKILL after the timeout)
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

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
    "venv_numpy_version",
    "venv_python_version",
]

#: Default backend folder inside NGC ``tritonserver`` containers.
NGC_BACKEND_DIR = pathlib.Path("/opt/tritonserver/backends")
#: Model control modes accepted by ``--model-control-mode``.
MODEL_CONTROL_MODES = ("none", "explicit", "poll")

_PORT_IN_USE = re.compile(r"already in use|Address already in use|failed to start (GRPC|HTTP|Metrics)", re.I)


#: MALLOC_MMAP_THRESHOLD_ for the server and its stubs (see TritonServer.environment).
MMAP_THRESHOLD_BYTES = 1 << 20


class TritonServerError(RuntimeError):
    """The server could not be found, did not start, or died; the message carries the log tail."""


@dataclasses.dataclass(frozen=True)
class TritonPaths:
    """Where a Triton installation lives.

    Attributes:
        binary: the ``tritonserver`` executable.
        backend_dir: the installation's backend folder (``<dir>/python/libtriton_python.so``, ...).
        lib_dirs: folders to put on ``LD_LIBRARY_PATH`` (the wheel's ``nvidia_pytriton.libs``; empty in NGC).
        stubs_dir: the wheel's ``python_backend_stubs`` folder (one ``<X.Y>/triton_python_backend_stub``
            per Python version), or None when the backend folder already holds its stub (NGC).
        source: ``"pytriton"``, ``"env"`` (``TRITONSERVER``), ``"explicit"`` or ``"path"``.
    """

    binary: pathlib.Path
    backend_dir: pathlib.Path
    lib_dirs: tuple[pathlib.Path, ...] = ()
    stubs_dir: pathlib.Path | None = None
    source: str = "pytriton"

    def stub_versions(self) -> list[str]:
        """Python versions (``"3.11"``) the wheel has a python-backend stub for."""
        if self.stubs_dir is None:
            return []
        return sorted(p.parent.name for p in self.stubs_dir.glob("*/triton_python_backend_stub"))


def _pytriton_paths() -> TritonPaths | None:
    """Locate the server inside an installed nvidia-pytriton wheel without importing pytriton."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = pathlib.Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        return None
    # Wheel install: libs sit next to the package; an editable pytriton checkout keeps them in external_libs.
    lib_dirs = [p for p in (root.parent.parent / "nvidia_pytriton.libs", root / "external_libs") if p.is_dir()]
    return TritonPaths(
        binary=binary,
        backend_dir=root / "backends",
        lib_dirs=tuple(lib_dirs),
        stubs_dir=root / "python_backend_stubs",
        source="pytriton",
    )


def _external_paths(binary: str | os.PathLike, backend_dir: str | os.PathLike | None, source: str) -> TritonPaths:
    resolved = shutil.which(str(binary)) if os.sep not in str(binary) else str(binary)
    if not resolved or not os.path.isfile(resolved):
        raise TritonServerError(f"tritonserver binary not found: {binary!r} ({source})")
    binary_path = pathlib.Path(resolved).absolute()
    if backend_dir is None:
        backend_dir = os.environ.get("TRITONSERVER_BACKEND_DIR")
    if backend_dir is None:
        sibling = binary_path.parent.parent / "backends"  # /opt/tritonserver/bin/.. -> /opt/tritonserver/backends
        backend_dir = sibling if sibling.is_dir() else NGC_BACKEND_DIR
    return TritonPaths(binary=binary_path, backend_dir=pathlib.Path(backend_dir), source=source)


def find_tritonserver(
    binary: str | os.PathLike | None = None, backend_dir: str | os.PathLike | None = None
) -> TritonPaths:
    """Find a ``tritonserver`` installation.

    Order: ``binary`` argument, ``TRITONSERVER`` env var (a path or a name on ``PATH``), the installed
    nvidia-pytriton wheel, then ``tritonserver`` on ``PATH`` (NGC containers). For the non-wheel cases the
    backend folder is ``backend_dir``, ``TRITONSERVER_BACKEND_DIR``, ``<binary>/../../backends`` or
    ``/opt/tritonserver/backends``.

    Raises:
        TritonServerError: nothing found.
    """
    if binary is not None:
        return _external_paths(binary, backend_dir, "explicit")
    if os.environ.get("TRITONSERVER"):
        return _external_paths(os.environ["TRITONSERVER"], backend_dir, "env")
    paths = _pytriton_paths()
    if paths is not None:
        if backend_dir is not None:
            paths = dataclasses.replace(paths, backend_dir=pathlib.Path(backend_dir), stubs_dir=None)
        return paths
    if shutil.which("tritonserver"):
        return _external_paths("tritonserver", backend_dir, "path")
    raise TritonServerError(
        "no tritonserver found: install nvidia-pytriton (pip install nvidia-pytriton==0.7.0), "
        "or set TRITONSERVER=/path/to/tritonserver"
    )


def venv_python_version(venv: str | os.PathLike) -> str:
    """``"X.Y"`` of the Python a venv was made from (read from ``pyvenv.cfg``, else by running it)."""
    cfg = pathlib.Path(venv) / "pyvenv.cfg"
    if cfg.is_file():
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("version", "version_info"):
                return ".".join(value.strip().split(".")[:2])
    python = pathlib.Path(venv) / "bin" / "python3"
    out = subprocess.run(
        [str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.strip()


def venv_numpy_version(venv: str | os.PathLike) -> str | None:
    """numpy version installed in a venv (from its ``.dist-info`` folder name), or None."""
    found = sorted(pathlib.Path(venv).glob("lib/python*/site-packages/numpy-*.dist-info"))
    return found[-1].name[len("numpy-"):-len(".dist-info")] if found else None


def _cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "s3flow" / "tritonserver"


def prepare_backend_dir(
    paths: TritonPaths, python_version: str | None = None, cache_dir: str | os.PathLike | None = None
) -> pathlib.Path:
    """Return a backend folder whose ``python/`` holds the stub for ``python_version``.

    The wheel keeps its stubs outside the backend folder (pytriton copies the whole server into a
    workspace). Here we build ``<cache>/<hash>-py<X.Y>/`` once, made of symlinks to the wheel's backends plus
    the matching stub, and reuse it; it is created under a temporary name and renamed, so concurrent
    launchers are safe. Installations whose backend folder already has a stub (NGC) are returned as is.

    Args:
        paths: from :func:`find_tritonserver`.
        python_version: ``"3.11"``; defaults to the running interpreter's.
        cache_dir: where to build; defaults to ``$XDG_CACHE_HOME/s3flow/tritonserver``.

    Raises:
        TritonServerError: the wheel has no stub for ``python_version``.
    """
    if paths.stubs_dir is None or (paths.backend_dir / "python" / "triton_python_backend_stub").exists():
        return paths.backend_dir
    version = python_version or "%d.%d" % sys.version_info[:2]
    stub = paths.stubs_dir / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonServerError(
            f"the Triton wheel has no python-backend stub for Python {version} "
            f"(has {paths.stub_versions()}); make the model venv with one of those system Pythons"
        )
    key = hashlib.sha1(f"{paths.backend_dir.resolve()}:{stub.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    root = pathlib.Path(cache_dir) if cache_dir is not None else _cache_root()
    target = root / f"{key}-py{version}"
    if (target / "python" / "triton_python_backend_stub").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        for backend in paths.backend_dir.iterdir():
            if not backend.is_dir():
                continue
            (tmp / backend.name).mkdir()
            for item in backend.iterdir():
                if item.name != "__pycache__":
                    (tmp / backend.name / item.name).symlink_to(item.resolve())
        (tmp / "python" / "triton_python_backend_stub").symlink_to(stub.resolve())
        tmp.chmod(0o755)
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "python" / "triton_python_backend_stub").exists():
            raise
    return target


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it; another process may still take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _log_tail(path: pathlib.Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    # Triton prints long config dumps and tables; keep the last lines that say something.
    text = [line for line in text if line.strip() and not line.startswith(("+", "|"))]
    return "\n".join(text[-lines:])


def read_cmdline(pid: int) -> list[str] | None:
    """argv of a running process (Linux ``/proc``), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        if state in (b"Z", b"X"):
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (OSError, IndexError):
        return None


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    return read_cmdline(pid) is not None


def stop_pid(pid: int, timeout: float = 30.0, kill_group: bool = True) -> bool:
    """Stop one process by PID: SIGTERM, wait up to ``timeout`` s, then SIGKILL.

    Works for processes that are not our children (a server started by ``scripts/server.py start``). If the
    process leads its own process group (``start_new_session=True``), the SIGKILL goes to that group so the
    python-backend stubs go too. Nothing is ever looked up by name.

    Returns:
        True if it exited after SIGTERM, False if it had to be killed (or was already gone).
    """
    if not is_running(pid):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_running(pid):
            return True
        time.sleep(0.05)
    _kill(pid, kill_group)
    deadline = time.monotonic() + 10
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return False


def _kill(pid: int, kill_group: bool) -> None:
    try:
        if kill_group and os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _default_venv() -> pathlib.Path | None:
    return pathlib.Path(sys.prefix) if sys.prefix != sys.base_prefix else None


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
        drain_s: run the server under ``s3flow.serving.drain supervise``: SIGTERM (``stop``) first drains (new
            sequences refused, those in flight finish) for up to this many seconds; None: plain tritonserver.
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
    ) -> None:
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
        self.venv = _default_venv() if venv == "auto" else (pathlib.Path(venv).absolute() if venv else None)
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.paths = paths or find_tritonserver()
        self.shm_byte_size = shm_byte_size
        self.drain_s = drain_s
        self.drain_file = (pathlib.Path(tempfile.mkdtemp(prefix="s3flow-drain-")) / "draining"
                           if drain_s is not None else None)
        self.shm_prefix = f"s3flow_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.process: subprocess.Popen | None = None
        self._log_handle = None
        self._port_retries = 2

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
        if not _has_nvidia_gpu():
            cmd.append("--allow-gpu-metrics=false")  # otherwise: "Error: Failed to initialize NVML" in the log
        cmd += [f"--load-model={name}" for name in self.load_models]
        cmd += self.extra_args
        if self.drain_s is None:
            return cmd
        python = str(self.venv / "bin" / "python3") if self.venv is not None else sys.executable
        return [python, "-m", "s3flow.serving.drain", "supervise", f"--deadline-s={self.drain_s}",
                f"--drain-file={self.drain_file}",
                f"--metrics-url=http://{self.host}:{self.metrics_port}/metrics", "--"] + cmd

    @property
    def draining(self) -> bool:
        """A drain has started (the supervisor made the drain file)."""
        return self.drain_file is not None and self.drain_file.exists()

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
        env.update(self.extra_env)
        return env

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process under it (the python-backend stubs)."""
        return tree_rss_bytes(self.pid) if self.pid is not None else 0

    def _python_version(self) -> str | None:
        return venv_python_version(self.venv) if self.venv is not None else None

    def _check_venv(self) -> None:
        if not (self.venv / "bin" / "python3").exists():
            raise TritonServerError(f"venv has no bin/python3: {self.venv}")
        numpy_version = venv_numpy_version(self.venv)
        if numpy_version is not None and int(numpy_version.split(".")[0]) >= 2:
            # Measured with this wheel's stub: numpy 2 silently corrupts tensors (inputs repeated, outputs empty).
            raise TritonServerError(
                f"numpy {numpy_version} in {self.venv}: the python-backend stub needs numpy<2 (pip install 'numpy<2')"
            )

    # ----------------------------------------------------------------------------------------- lifecycle
    def start(self) -> TritonServer:
        """Launch the server in its own session and return at once (see :meth:`wait_ready`)."""
        if self.process is not None and self.process.poll() is None:
            raise TritonServerError(f"server already running (pid {self.process.pid})")
        if self.venv is not None:
            self._check_venv()
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
        self._log_handle.write(("$ " + " ".join(cmd) + "\n").encode())
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
        """Poll gRPC live+ready until both hold; return the seconds waited.

        Raises:
            TritonServerError: the process exited (with its exit code and log tail), or ``timeout`` passed
                (the server is stopped first).
        """
        from tritonclient.utils import InferenceServerException

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
                    f"(log {self.log_file}):\n{_log_tail(self.log_file)}"
                )
            # A gRPC channel that failed to connect backs off for seconds before it retries, so wait for
            # the port to accept TCP first and use a fresh client for each probe.
            if _port_open(self.host, self.grpc_port):
                client = self.client()
                try:
                    if client.is_server_live(client_timeout=2.0) and client.is_server_ready(client_timeout=2.0):
                        self._wait_metrics_port(start + timeout)
                        return time.monotonic() - start
                except InferenceServerException:
                    pass
                finally:
                    client.close()
            if time.monotonic() - start > timeout:
                self.stop()
                raise TritonServerError(
                    f"tritonserver not ready after {timeout:.0f} s (log {self.log_file}):\n"
                    f"{_log_tail(self.log_file)}"
                )
            time.sleep(0.1)

    def _wait_metrics_port(self, until: float) -> None:
        """Triton opens its metrics port a moment after it reports ready: wait for it (bounded)."""
        if "--allow-metrics=false" in self.extra_args:
            return
        while not _port_open(self.host, self.metrics_port) and time.monotonic() < until:
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

        Returns the exit code (None if never started). Also removes this server's python-backend
        shared-memory files from ``/dev/shm`` if a kill left them behind.
        """
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout + (self.drain_s or 0.0))
            except subprocess.TimeoutExpired:
                _kill(self.process.pid, kill_group=True)
                self.process.wait(10)
        self._close_log()
        self._cleanup_shm()
        return self.process.returncode

    def _cleanup_shm(self) -> None:
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
        return _log_tail(self.log_file, lines)

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"TritonServer(pid={self.pid}, grpc={self.grpc_url}, repository={self.model_repository})"


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants, from /proc (0 for processes already gone)."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return total


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _has_nvidia_gpu() -> bool:
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
