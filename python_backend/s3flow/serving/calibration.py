"""The solver's capacity at load: the default START's planned work, and real timed calls to price it.

Admission by capacity (``s3flow.serving.admission``) needs the solver's cost fits (``s3flow.engine.capacity``)
before the first stream comes, or the first burst would all be admitted unpriced. The warm-up in ``initialize``
runs stand-in networks (the encoder and estimator may still be loading then), so a :class:`Calibration` thread
runs the warm-up's utterance through the real networks over BLS once they are up (one stream, then four
at once, 2 Euler steps: a few calls at two batch sizes; each batch only while no served stream is live) and feeds
the timings to the fits; from then on every served call refines them.

The thread makes no BLS call before ``ready()`` holds. In the python backend (r24.10, ``python_be.cc``
``LaunchStubProcess``) the server reads a stub's messages from before the stub's ``initialize`` on, but creates the
pool that runs its BLS requests only after it: a BLS request sent from a thread in that window makes tritonserver
dereference the missing pool (SIGSEGV at load, seen once in CI). Asking Triton whether a model is ready from the
thread (``pb_utils.is_model_ready``) is no way out: on this build it rarely returned and the server aborted at its
stop (``boost::interprocess::lock_exception``, 13 of 15 starts). The solver passes a ``ready`` that holds once
Triton has called its ``execute`` (the first call proves the instance is set up): its own ``model_warmup``
request (``s3flow.repository.warmup_samples.solver_set_up``), which Triton sends right after the instance is set
up, or else its first real request.

Example::

    plan, steps, rows = planned_start(settings, n_feats=80, meanflow=False)
    calibration = Calibration(engine, capacity_model, settings.rules, "cfm_solver", log=print,
                              ready=lambda: True).start()
    ...
    calibration.stop()            # finalize(): no call may be in flight while Triton tears the instance down
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from s3flow_contract.tensors import FRAMES_PER_SECOND
from s3flow.engine.capacity import CapacityModel, Plan, default_plan
from s3flow.engine.planning import plan_work
from s3flow.engine.settings import SolverSettings
from s3flow.model.solver import default_steps
from s3flow.serving.warmup import calibrate_solver

#: the speaker prompt a planned START brings (tokens; 6 s), before the solver's own cap on the prompt
PLANNED_PROMPT_TOKENS = 150
#: how far past the expected length the plan goes chunk by chunk (longer streams: its last chunk again and again)
PLAN_BEYOND_S = 12.0


def planned_start(settings: SolverSettings, n_feats: int, meanflow: bool) -> tuple[Plan, int, int]:
    """(plan, steps, rows per step) of a default utterance: the client's default chunk plan, at the default steps
    and guidance, with a 6 s prompt, in the served chunk settings, expected to last ``expected_utterance_s``."""
    solving, expected_s = settings.solving, settings.admission.expected_utterance_s
    steps = solving.default_steps or default_steps(meanflow)
    guided = not meanflow and solving.default_guidance_rate > 0
    sizes = default_plan(expected_s + PLAN_BEYOND_S)
    if len(sizes) > 1 and sizes[-1] < sizes[-2]:
        sizes = sizes[:-1]   # the plan ends on a whole chunk: a longer stream goes on in chunks of that size
    chunks = plan_work(n_feats, meanflow, steps, guided, sizes, PLANNED_PROMPT_TOKENS, solving.context_frames,
                       solving.prompt_frames, solving.slide_prompt, solving.keep_solved)
    return (Plan(chunks, round(FRAMES_PER_SECOND * expected_s), settings.deadlines.start_buffer_s), steps,
            2 if guided else 1)


class Calibration:
    """A daemon thread that calibrates ``model`` once through ``engine``'s real networks (module docstring), once
    ``ready()`` holds, retrying while they do not answer yet (for at most ``give_up_s`` in all)."""

    def __init__(self, engine, model: CapacityModel, rules, name: str, ready: Callable[[], bool],
                 log: Callable[[str], None] = print, give_up_s: float = 300.0, retry_s: float = 0.2,
                 closing: Callable[[], bool] = lambda: False, then: Callable[[], None] = lambda: None):
        """``ready()``: BLS calls may be made (module docstring); ``closing()``: the server is stopping (its
        models may no longer answer): the calibration stops before its next batch; ``then()``: called once it is
        over, calibrated or not (the solver publishes its load report: admission waits for the price)."""
        self.engine, self.model, self.rules, self.name, self.log, self.then = engine, model, rules, name, log, then
        self.ready, self.give_up_s, self.retry_s, self.closing = ready, give_up_s, retry_s, closing
        self.done, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-calibration", daemon=True)

    def start(self) -> "Calibration":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """No more calls: the calibration stops before its next batch; returns once its thread has (``finalize``:
        a BLS call from a thread while Triton tears the instance down crashed tritonserver at its stop)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _wait_idle(self) -> None:
        """Until the served engine holds no sequence (served streams go first; the calibration waits its turn);
        raises ``_Stopped`` once ``stop`` was called or the server closes."""
        while len(self.engine.sequences) and not self._stopping():
            time.sleep(0.2)
        if self._stopping():
            raise _Stopped

    def _stopping(self) -> bool:
        return self._stop.is_set() or self.closing()

    def _run(self) -> None:
        t0, last = time.monotonic(), None
        while time.monotonic() - t0 < self.give_up_s and not self._stopping():
            try:
                if not self.ready():   # no BLS call before the server can run it (module docstring)
                    last = "the models are not ready"
                    self._stop.wait(self.retry_s)
                    continue
                report = calibrate_solver(self.engine, self.model, self.rules, wait_idle=self._wait_idle)
            except _Stopped:
                break
            except Exception as exc:   # the networks are not loaded yet (BLS refuses): try again soon
                last = exc
                self._stop.wait(self.retry_s)
                continue
            e = self.model.estimator
            self.log(f"{self.name}: {report.describe()}: estimator {e.fixed * 1e3:.2f} ms + "
                     f"{e.per_unit * 1e6:.3f} us per row-frame, x{self.model.prior_correction:.2f} between calls")
            self._over()
            return
        why = "stopped" if self._stopping() else f"gave up after {self.give_up_s:.0f} s ({last})"
        self.log(f"{self.name}: calibration {why}; the costs come from served calls only")
        self._over()

    def _over(self) -> None:
        self.done.set()
        if not self._stopping():
            self.then()


class _Stopped(Exception):
    """The calibration was stopped (the model is being unloaded)."""
