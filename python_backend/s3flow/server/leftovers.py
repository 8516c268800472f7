"""What a server leaves in ``/dev/shm`` and the temp folder, and removing it: at its stop, and at the next start for
servers long gone.

A server's python models share small per-server folders, named by the server's PID (the models' parent):
``s3flow-<name>-<pid>`` (``s3flow.serving.records``: one folder per record); the python backend maps its shared-memory regions there as well, named
by ``--backend-config=python,shm-region-prefix-name`` (``s3flow_<launcher pid>_<random>`` for ``TritonServer``). A
server that exits cleanly removes its regions but not our folders, and one that is killed removes neither.

* :func:`remove_server_files` (``TritonServer.stop``, the drain supervisor when its child exits,
  ``scripts/server.py stop``): one server's folders;
* :func:`remove_stale` (``TritonServer.start``, its stop after a kill, the supervisor): the folders of PIDs that no
  longer run, and the ``s3flow_*`` regions that no process maps.

Two more live in the temp folder (``/tmp``). ``TritonServer`` keeps its drain marker in a folder of its own,
``s3flow-drain-<launcher pid>-<random>`` (:func:`new_drain_file`), removed at its stop (:func:`remove_drain_file`;
``scripts/server.py stop`` too). The python backend makes ``python_env_<random>`` as it loads and removes it at a
clean exit only: a killed server leaves it. :func:`remove_stale` sweeps both: drain folders whose launcher no longer
runs and that no running process reads (a server ``scripts/server.py start`` left running outlives its launcher),
and ``python_env_*`` folders made before every tritonserver that runs now started (no running server can own
them).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from s3flow.serving.draining import DRAIN_FILE_ENV
from s3flow.serving.records import SERVER_FOLDERS, server_folder

SHM = Path("/dev/shm")
#: the python-backend regions of our servers (``TritonServer.shm_prefix``; the entrypoint's prefix too)
REGION_PREFIX = "s3flow_"
#: a region younger than this may belong to a server starting now (created, not yet mapped): left alone
REGION_MIN_AGE_S = 60.0
#: folders older servers made that no record has now ("live": the live counts, in the load reports since)
RETIRED_FOLDERS = ("live",)
_FOLDER = re.compile(r"^s3flow-(?:" + "|".join(SERVER_FOLDERS + RETIRED_FOLDERS) + r")-(\d+)$")
#: ``TritonServer``'s drain-marker folders in the temp folder, named by the launching process; the drain
#: supervisor's default marker file (and its healing twin), named by the supervisor; the folders ``TritonServer``
#: made before 2026-12-06 (``mkdtemp``'s eight characters, no process named)
DRAIN_PREFIX = "s3flow-drain-"
_DRAIN_FOLDER = re.compile(r"^" + DRAIN_PREFIX + r"(\d+)-\w+$")
_SUPERVISOR_FILE = re.compile(r"^" + DRAIN_PREFIX + r"(\d+)(?:\.healing)?$")
_OLD_DRAIN_FOLDER = re.compile(r"^" + DRAIN_PREFIX + r"\w{8}$")
#: an old-style drain folder older than this, that no running process names, is stale
OLD_DRAIN_MIN_AGE_S = 3600.0
#: the python backend's folder for packed environments (python_backend src/pb_env.cc: ``/tmp/python_env_XXXXXX``)
PYTHON_ENV_PREFIX = "python_env_"
PYTHON_ENV_PARENT = Path("/tmp")
#: the name of the Triton server binary (its processes own the ``python_env_*`` folders)
TRITONSERVER = "tritonserver"


def server_folders(server_pid: int) -> list[Path]:
    """The per-server folders of the server with this PID (whether they exist or not)."""
    return [server_folder(name, server_pid) for name in SERVER_FOLDERS]


def remove_server_files(server_pid: int) -> int:
    """Remove one server's folders; returns how many there were."""
    gone = 0
    for folder in server_folders(server_pid):
        if folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            gone += 1
    return gone


def new_drain_file() -> Path:
    """A drain-marker path in a folder of its own, named by this (the launching) process; the server's start makes
    the folder (one never started leaves none)."""
    return Path(tempfile.gettempdir()) / f"{DRAIN_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}" / "draining"


def remove_drain_file(drain_file: Path) -> None:
    """The drain marker's folder and what is in it (the marker, its healing twin)."""
    shutil.rmtree(drain_file.parent, ignore_errors=True)


def _oldest_start(name: str = TRITONSERVER) -> float:
    """When the longest-running process of this name started (now, before looking, when none runs). psutil counts
    from the boot time in whole seconds (/proc/stat's btime, cut): up to 1 s early, the safe side here."""
    starts, now = [], time.time()
    for proc in psutil.process_iter(["name", "create_time"]):
        if proc.info["name"] == name and proc.info["create_time"] is not None:
            starts.append(proc.info["create_time"])
    return min(starts, default=now)


def _drain_names_in_use() -> set[str]:
    """The names in the temp folder that running processes read their drain marker from (``DRAIN_FILE_ENV``: a
    server's stubs and tritonserver itself): a server whose launcher has exited (``scripts/server.py start``) still
    reads its own."""
    names = set()
    for proc in psutil.process_iter():
        try:
            path = proc.environ().get(DRAIN_FILE_ENV)
        except psutil.Error:
            continue
        if path:
            names.update((Path(path).name, Path(path).parent.name))
    return names


def _stale_drain(entry: Path, in_use: set[str]) -> bool:
    """A drain marker's folder or file that no running process can still use."""
    if entry.name in in_use:
        return False
    if entry.is_dir():
        m = _DRAIN_FOLDER.match(entry.name)
        if m:
            return not psutil.pid_exists(int(m.group(1)))
        return bool(_OLD_DRAIN_FOLDER.match(entry.name)) and _age_s(entry) > OLD_DRAIN_MIN_AGE_S
    m = _SUPERVISOR_FILE.match(entry.name)
    return bool(m) and not psutil.pid_exists(int(m.group(1)))


def remove_stale_temp(temp: Path | None = None, envs: Path = PYTHON_ENV_PARENT,
                      server_name: str = TRITONSERVER) -> list[str]:
    """Remove the drain markers no running process can use (a ``TritonServer`` folder whose launcher is gone, a
    supervisor's file whose supervisor is, an old-style folder an hour old; none that a running process names in
    its environment) and the backend's ``python_env_*`` folders that no running tritonserver can own (made before
    the oldest of them started); returns the names removed."""
    removed, in_use = [], None
    temp = Path(tempfile.gettempdir()) if temp is None else temp
    markers = sorted(temp.glob(DRAIN_PREFIX + "*")) if temp.is_dir() else []
    for entry in markers:
        in_use = _drain_names_in_use() if in_use is None else in_use
        if _stale_drain(entry, in_use):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    if envs.is_dir():
        oldest = _oldest_start(server_name)
        for entry in envs.glob(PYTHON_ENV_PREFIX + "*"):
            try:
                made = entry.stat().st_ctime
            except OSError:
                continue
            if entry.is_dir() and made < oldest:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
    return removed


def _mapped_regions() -> set[str]:
    """The names of the ``/dev/shm`` files that some process maps (every process's memory maps)."""
    names = set()
    prefix = str(SHM) + "/"
    for proc in psutil.process_iter():
        try:
            maps = proc.memory_maps(grouped=False)
        except psutil.Error:
            continue
        names.update(m.path[len(prefix):] for m in maps if m.path.startswith(prefix))
    return names


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def remove_stale(shm: Path = SHM, temp: Path | None = None, envs: Path = PYTHON_ENV_PARENT) -> list[str]:
    """Remove the per-server folders of servers that no longer run, our regions that nobody maps, and what
    :func:`remove_stale_temp` sweeps; returns the names removed."""
    removed, mapped = remove_stale_temp(temp, envs), None
    if not shm.is_dir():
        return removed
    for entry in shm.iterdir():
        m = _FOLDER.match(entry.name)
        if m and entry.is_dir() and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
        elif entry.name.startswith(REGION_PREFIX) and entry.is_file() and _age_s(entry) > REGION_MIN_AGE_S:
            mapped = _mapped_regions() if mapped is None else mapped
            if entry.name not in mapped:
                try:
                    entry.unlink()
                    removed.append(entry.name)
                except OSError:
                    pass
    return removed
