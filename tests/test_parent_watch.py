"""A process under ``s3flow.serving.parent_watch`` goes when its parent dies, even while the dead parent is an
unreaped zombie (what ``kill(pid, 0)``, the python backend stub's own check, takes for alive) and while one of its
threads holds the GIL for good (a stub's call into its dead server does); the watch itself outlives neither. No
server here: test_shutdown does the same to a real tritonserver and its stubs."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: the parent starts a watched child, prints the child's PID and what the child said, and waits to be killed
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(600)
"""
CHILD = """
import ctypes, threading, time
from s3flow.serving.parent_watch import watch_parent
watch = watch_parent(period_s=0.1)
print(watch.pid, flush=True)
if {hold_gil}:   # libc's sleep through PyDLL keeps the GIL: no Python thread runs again
    threading.Thread(target=lambda: ctypes.PyDLL(None).sleep(600), daemon=True).start()
time.sleep(600)
"""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _wait_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while _state(pid) not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    return _state(pid) in ("gone", "Z")


@pytest.mark.parametrize("hold_gil", [False, True], ids=["idle", "gil-held"])
def test_a_watched_process_is_killed_when_its_parent_dies_and_is_left_a_zombie(hold_gil):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD.format(hold_gil=hold_gil)],
                              stdout=subprocess.PIPE, text=True)
    child_pid, watch_pid = (int(x) for x in parent.stdout.readline().split())
    try:
        time.sleep(0.3)   # the GIL taken for good, where asked
        assert _state(child_pid) not in ("gone", "Z") and _state(watch_pid) not in ("gone", "Z")
        os.kill(parent.pid, signal.SIGKILL)   # and not reaped until the end: a zombie
        assert _wait_gone(child_pid, 10), "the child outlived its parent by 10 s"
        assert _state(parent.pid) == "Z", "the parent stays unreaped while the child is checked"
        assert _wait_gone(watch_pid, 5), "the watch outlived the child it killed"
    finally:
        for pid in (child_pid, watch_pid):
            if _state(pid) not in ("gone", "Z"):
                os.kill(pid, signal.SIGKILL)
        parent.wait(10)


def test_the_watch_is_one_per_process_leaves_a_living_parent_alone_and_goes_with_its_process():
    out = subprocess.run([sys.executable, "-c", """
import time
from s3flow.serving.parent_watch import watch_parent
a, b = watch_parent(period_s=0.05), watch_parent(period_s=0.05)
time.sleep(0.5)
print(a is b, a.poll() is None, a.pid)
"""], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    same, running, watch_pid = out.stdout.split()
    assert (same, running) == ("True", "True"), out.stdout + out.stderr
    assert _wait_gone(int(watch_pid), 2), "a process that exits normally takes its watch with it"


def test_the_watch_of_a_killed_process_ends_by_itself():
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(hold_gil=False)], stdout=subprocess.PIPE, text=True)
    watch_pid = int(child.stdout.readline())
    child.kill()   # no atexit
    child.wait(10)
    assert _wait_gone(watch_pid, 5), "the watch outlived the process it watched"


def test_the_server_watched_is_the_one_a_stub_was_started_for_from_its_command_line():
    from s3flow.serving.parent_watch import server_pid

    stub = ["/opt/tritonserver/backends/python/triton_python_backend_stub", "/repo/cfm_solver/1/model.py",
            "s3flow_12_ab", "1048576", "1048576", "4156", "/opt/tritonserver/backends/python", "336",
            "cfm_solver_0_0", "DEFAULT"]
    assert server_pid(stub) == 4156
    assert server_pid([sys.executable, "-c", "pass"]) == os.getppid()   # not a stub: its parent


def test_a_process_whose_server_left_before_its_watch_started_is_killed_at_the_first_look():
    """A server stopped while a stub still loads leaves before the stub's watch starts: the stub's parent is
    then init, not the server it was started for, and the watch must act at once, not watch init."""
    server = subprocess.Popen(["sleep", "60"])   # alive, and not the child's parent (this process is)
    child = subprocess.Popen([sys.executable, "-c", CHILD.replace(
        "watch_parent(period_s=0.1)", f"watch_parent(period_s=0.1, parent={server.pid})").format(hold_gil=False)],
        stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        child.wait(10)
        assert child.returncode == -signal.SIGKILL, f"the watch let it live (exit {child.returncode})"
    finally:
        for p in (child, server):
            if p.poll() is None:
                p.kill()
                p.wait(10)
