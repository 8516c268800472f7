"""Where a ``tritonserver`` installation is, and a backend folder whose python backend runs our venv's Python.

Two ways to get a server binary are supported:

* **The nvidia-pytriton wheel** (the default on a plain host): the wheel ships ``tritonserver``, its shared
  libraries (``site-packages/nvidia_pytriton.libs``), the python backend and one python-backend stub per
  Python version (``pytriton/tritonserver/python_backend_stubs/<X.Y>/``). The stub is *not* inside the
  backend folder, so :func:`prepare_backend_dir` builds a small backend folder (symlinks, kept in a cache
  folder) whose ``python/`` holds the stub for the Python version of the model venv.
* **An NGC container / own build**: set ``TRITONSERVER`` (path or name on ``PATH``) or pass ``binary=``;
  backends default to ``/opt/tritonserver/backends`` (override with ``TRITONSERVER_BACKEND_DIR``).

Example::

    paths = find_tritonserver()
    backend_dir = prepare_backend_dir(paths, venv_python_version(".venv"))
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

#: Default backend folder inside NGC ``tritonserver`` containers.
NGC_BACKEND_DIR = pathlib.Path("/opt/tritonserver/backends")


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


def default_venv() -> pathlib.Path | None:
    """The venv running this code (None outside a venv)."""
    return pathlib.Path(sys.prefix) if sys.prefix != sys.base_prefix else None


def check_venv(venv: pathlib.Path) -> None:
    """Raise TritonServerError unless ``venv`` can run the python models (a python3, numpy below 2)."""
    if not (venv / "bin" / "python3").exists():
        raise TritonServerError(f"venv has no bin/python3: {venv}")
    numpy_version = venv_numpy_version(venv)
    if numpy_version is not None and int(numpy_version.split(".")[0]) >= 2:
        # Measured with this wheel's stub: numpy 2 silently corrupts tensors (inputs repeated, outputs empty).
        raise TritonServerError(
            f"numpy {numpy_version} in {venv}: the python-backend stub needs numpy<2 (pip install 'numpy<2')"
        )
