"""Processes and ports by number, never by name: free ports, a process's argv, environment and liveness
(psutil), stopping one PID (SIGTERM, then SIGKILL of its group), the resident memory of a process tree, a log's
tail.
"""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import time

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it; another process may still take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: pathlib.Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a server log that say something (no blank lines, no table rows)."""
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    # Triton prints long config dumps and tables; keep the last lines that say something.
    text = [line for line in text if line.strip() and not line.startswith(("+", "|"))]
    return "\n".join(text[-lines:])


def read_environ(pid: int) -> dict[str, str]:
    """The environment a running process started with (empty if unreadable)."""
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


def read_cmdline(pid: int) -> list[str] | None:
    """argv of a running process, or None if it is gone or a zombie."""
    try:
        p = psutil.Process(pid)
        return None if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else p.cmdline()
    except psutil.Error:
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
    kill(pid, kill_group)
    deadline = time.monotonic() + 10
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return False


def kill(pid: int, kill_group: bool) -> None:
    try:
        if kill_group and os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants (just ``pid`` if it is gone)."""
    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return [pid]


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants (0 for processes already gone)."""
    total = 0
    for p in tree_pids(pid):
        try:
            total += psutil.Process(p).memory_info().rss
        except psutil.Error:
            pass
    return total


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def has_nvidia_gpu() -> bool:
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
