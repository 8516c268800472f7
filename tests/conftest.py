import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

import pytest  # noqa: E402


#: The modules that take longest, longest first (seconds summed over their tests under two workers on 2 cores,
#: 2026-12-06: healing 115, model_analyzer 111, vocoder 100, perf_analyzer 92, shutdown 84, training 79, faults 70,
#: resume 66, gpu_path 61, overload 52, triton_server 49, estimator 43 of 1,542 in all); the rest keep file order.
#: ``make test`` runs ``pytest -n 2 --dist loadfile --no-loadscope-reorder``: xdist hands a worker the next module
#: in this order when the one it runs is nearly done (2 tests or fewer left), so the long ones go early and the
#: end is short ones on both workers (xdist's own order, most tests first, left Model Analyzer's single 111 s test
#: for last, alone: about 50 s of one idle worker).
SLOWEST_FIRST = ("test_healing", "test_model_analyzer", "test_vocoder", "test_perf_analyzer", "test_shutdown",
                 "test_training", "test_faults", "test_resume", "test_gpu_path", "test_overload", "test_triton_server",
                 "test_estimator")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # (a stable sort)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread in a module (small tensors; the host is shared), restored after it: other modules
    compare in-process results bit for bit with subprocesses that run on torch's default. Use with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def torch_threads_restored():
    """Every module starts on torch's default thread count, whatever an earlier one (or a tool it ran in process)
    set: some compare in-process results bit for bit with a subprocess's, which runs on the default, and under
    ``pytest -n`` a worker's module order is not the file order."""
    import torch

    _TORCH_DEFAULT.setdefault("threads", torch.get_num_threads())   # (read before any module set it)
    torch.set_num_threads(_TORCH_DEFAULT["threads"])
    yield


_TORCH_DEFAULT: dict = {}


@pytest.fixture(scope="session", autouse=True)
def one_instance_layout():
    """The suite's repositories run one solver and one estimator instance unless a test names its layout: each
    instance is a stub process (the solver's imports torch), and the suite starts about 47 servers (the shipped CPU
    layout, two of each, added minutes). tests/test_layout.py serves the shipped layout (``shipped_layout``)."""
    from s3flow.repository import settings

    shipped = {target: dict(counts) for target, counts in settings.DEFAULT_INSTANCES.items()}
    settings.DEFAULT_INSTANCES["cpu"] = {"solver_instances": 1, "estimator_instances": 1}
    yield shipped
    settings.DEFAULT_INSTANCES.update(shipped)


@pytest.fixture(scope="module")
def shipped_layout(one_instance_layout):
    """The shipped layouts (``DEFAULT_INSTANCES`` as the package has them) for one module's repositories."""
    from s3flow.repository import settings

    pinned = {target: dict(counts) for target, counts in settings.DEFAULT_INSTANCES.items()}
    settings.DEFAULT_INSTANCES.update(one_instance_layout)
    yield one_instance_layout
    settings.DEFAULT_INSTANCES.update(pinned)


@pytest.fixture(scope="session", autouse=True)
def background_stops():
    """Servers made with ``background_stop=True`` (most modules' shared servers) stop while the next module
    starts its own; the session ends only once every one has ended, and each must have left with its stop."""
    yield
    from s3flow.server.triton_server import wait_background_stops

    stopped = wait_background_stops()
    groups = {s.pid for s in stopped}   # each server leads its own process group, its stubs in it
    # a stub Triton did not wait for (a healed server's stop ends at its exit timeout) leaves at its parent watch's
    # next look (0.5 s): tests/test_shutdown.py's bound for that
    deadline = time.monotonic() + 10.0
    while True:
        left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _group_of(pid) in groups]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes of stopped servers still run 10 s after their server: {left}"
    unclean = {s.pid: s.process.returncode for s in stopped if s.process.returncode != 0 and not s.heal}
    assert not unclean, f"servers that did not stop on SIGTERM (pid: exit code): {unclean}"


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
