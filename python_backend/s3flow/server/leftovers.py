"""What a server leaves in ``/dev/shm``, and removing it: at its stop, and at the next start for servers long gone.

A server's python models share small per-server folders, named by the server's PID (the models' parent):
``s3flow-<name>-<pid>`` (``s3flow.serving.records``: one folder per record); the python backend maps its shared-memory regions there as well, named
by ``--backend-config=python,shm-region-prefix-name`` (``s3flow_<launcher pid>_<random>`` for ``TritonServer``). A
server that exits cleanly removes its regions but not our folders, and one that is killed removes neither.

* :func:`remove_server_files` (``TritonServer.stop``, the drain supervisor when its child exits,
  ``scripts/server.py stop``): one server's folders;
* :func:`remove_stale` (``TritonServer.start``, the supervisor): the folders of PIDs that no longer run, and the
  ``s3flow_*`` regions that no process maps.
"""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import psutil

from s3flow.serving.records import SERVER_FOLDERS, server_folder

SHM = Path("/dev/shm")
#: the python-backend regions of our servers (``TritonServer.shm_prefix``; the entrypoint's prefix too)
REGION_PREFIX = "s3flow_"
#: a region younger than this may belong to a server starting now (created, not yet mapped): left alone
REGION_MIN_AGE_S = 60.0
#: folders older servers made that no record has now ("live": the live counts, in the load reports since)
RETIRED_FOLDERS = ("live",)
_FOLDER = re.compile(r"^s3flow-(?:" + "|".join(SERVER_FOLDERS + RETIRED_FOLDERS) + r")-(\d+)$")


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


def remove_stale(shm: Path = SHM) -> list[str]:
    """Remove the per-server folders of servers that no longer run and our regions that nobody maps; returns the
    names removed."""
    if not shm.is_dir():
        return []
    removed, mapped = [], None
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
