"""Processes and ports by number, never by name: free ports, a process's argv and liveness from ``/proc``,
stopping one PID (SIGTERM, then SIGKILL of its group), the resident memory of a process tree, a log's tail.
"""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import time


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
    """The environment a running process started with (Linux ``/proc``; empty if unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [a.decode(errors="replace").split("=", 1) for a in f.read().split(b"\0") if b"=" in a]
    except OSError:
        return {}
    return dict(pairs)


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
    """``pid`` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants, from /proc (0 for processes already gone)."""
    total = 0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
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
