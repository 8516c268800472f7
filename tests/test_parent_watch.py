"""A process under ``s3flow.serving.parent_watch`` exits when its parent dies, even while the dead parent is an
unreaped zombie (what ``kill(pid, 0)``, the python backend stub's own check, takes for alive). No server here:
test_shutdown does the same to a real tritonserver and its stubs."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from s3flow.serving.parent_watch import EXIT_CODE

#: the parent starts a watched child, prints its PID, and waits to be killed
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(600)
"""
CHILD = """
import time
from s3flow.serving.parent_watch import watch_parent
watch_parent(period_s=0.1)
print("watching", flush=True)
time.sleep(600)
"""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_watched_process_exits_when_its_parent_is_killed_and_left_a_zombie():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    child_pid, said = parent.stdout.readline().split()
    child_pid = int(child_pid)
    assert said == "watching"
    try:
        os.kill(parent.pid, signal.SIGKILL)   # and not reaped until the end: a zombie
        deadline = time.monotonic() + 10
        while _state(child_pid) not in ("gone", "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(parent.pid) == "Z", "the parent stays unreaped while the child is checked"
        assert _state(child_pid) in ("gone", "Z"), "the child outlived its parent by 10 s"
    finally:
        if _state(child_pid) not in ("gone", "Z"):
            os.kill(child_pid, signal.SIGKILL)
        parent.wait(10)


def test_the_watch_is_one_per_process_and_leaves_a_living_parent_alone():
    out = subprocess.run([sys.executable, "-c", """
import time
from s3flow.serving.parent_watch import watch_parent
a, b = watch_parent(period_s=0.05), watch_parent(period_s=0.05)
time.sleep(0.5)
print(a is b, a.is_alive())
"""], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], out.stdout + out.stderr
    assert EXIT_CODE != 0
