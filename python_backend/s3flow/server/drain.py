"""Graceful drain: a server that is going away finishes the utterances in flight and takes no new ones.

The server side is a file. While the file named by ``S3FLOW_DRAIN_FILE`` (in the server's environment)
exists, the solver answers every START with UNAVAILABLE, disposition ``resume`` (``s3flow.serving.draining``),
and goes on serving the sequences it holds. To drain: create the file, then wait until the
solvers hold no sequence (their ``s3flow_live_sequences`` gauges on the metrics port sum to 0) or a deadline
passes; then stop the server. Utterances still open at the deadline break, and a resuming client
(``StreamingClient`` with several addresses) replays them on another server.

Triton 2.51 itself closes its gRPC streams at once on SIGTERM, so the drain must come before Triton's
SIGTERM. Three entry points (``python -m s3flow.server.drain ...``):

* ``supervise [--deadline-s 60] -- tritonserver ARGS``: run the server as a child; on SIGTERM or SIGINT drain,
  then SIGTERM the server and exit with its code (the container's entrypoint, ``TritonServer(drain_s=...)``);
* ``drain [--deadline-s 60]``: the drain alone (a Kubernetes ``preStop`` hook; SIGTERM follows it);
* ``ready [--priced]``: exit 0 only if the server is ready, not draining and not reloading a model whose stub died
  (with ``--priced``: and its solver has priced its work, read on ``--metrics-url``) (a
  readiness probe: the router stops sending new sequences as soon as a drain starts);
* ``live [--heal-bound-s 60]``: exit 0 only if the server is live and no model has been dead longer than the
  bound (a liveness probe: a server that cannot heal is restarted).

Example::

    python -m s3flow.server.drain supervise --deadline-s 60 --metrics-url http://127.0.0.1:8002/metrics -- \\
        tritonserver --model-repository=model_repository
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Callable, Optional

from s3flow.server.access import admin_headers, read_admin_key
from s3flow.server.healing import StubWatch
from s3flow.server.leftovers import remove_server_files, remove_stale
from s3flow.server.metrics_reader import metric_sum, priced, read_metrics
from s3flow.serving.draining import DRAIN_FILE_ENV, mark_closing, mark_draining
from s3flow.serving.metrics import LIVE, VOCODER_LIVE

DEFAULT_DEADLINE_S = 60.0     # the longest utterance (60 s of audio) streams in well under this on a GPU
LIVE_METRIC = LIVE.name


def live_sequences(metrics_url: str, timeout_s: float = 3.0) -> int:
    """Sum of the solvers' ``s3flow_live_sequences`` gauges (``metrics_url``: host:port or a URL)."""
    return int(metric_sum(read_metrics(metrics_url, timeout_s=timeout_s), LIVE_METRIC))


def drain(drain_file: str, metrics_url: str, deadline_s: float = DEFAULT_DEADLINE_S, poll_s: float = 0.2,
          log: Callable[[str], None] = print, give_up: Callable[[], bool] = lambda: False) -> dict:
    """Start draining (create ``drain_file``) and wait until no sequence is live, ``deadline_s`` passes or
    ``give_up()`` (a second signal).

    Returns ``{"drained": bool, "seconds": float, "live_at_start": int, "live_at_end": int}``; a metrics
    port that does not answer counts as drained (the server is gone already).
    """
    mark_draining(drain_file)
    t0 = time.monotonic()

    def live() -> int:
        try:
            return live_sequences(metrics_url)
        except (OSError, urllib.error.URLError):
            return 0

    first = now = live()
    log(f"[s3flow drain] draining: new sequences refused, {first} live; deadline {deadline_s:.0f} s")
    while now > 0 and time.monotonic() - t0 < deadline_s and not give_up():
        time.sleep(poll_s)
        now = live()
    seconds = time.monotonic() - t0
    log(f"[s3flow drain] {'drained' if now == 0 else f'deadline passed with {now} live'} after {seconds:.1f} s")
    return {"drained": now == 0, "seconds": seconds, "live_at_start": first, "live_at_end": now}


def close(drain_file: str, metrics_url: str, timeout_s: float = 10.0, poll_s: float = 0.1,
          log: Callable[[str], None] = print) -> bool:
    """After a drain (or instead of one): the solver and the vocoder drop what they still hold and give Triton the
    sequence slots back (``s3flow.serving.draining``), so that the SIGTERM that follows finds no open sequence to
    wait for. Waits until they hold nothing (their live gauges sum to 0) or ``timeout_s``; True when they do."""
    mark_closing(drain_file)
    t0 = time.monotonic()

    def held() -> int:
        try:
            metrics = read_metrics(metrics_url, timeout_s=3.0)
        except (OSError, urllib.error.URLError):
            return 0
        return int(metric_sum(metrics, LIVE_METRIC) + metric_sum(metrics, VOCODER_LIVE.name))

    now = held()
    while now > 0 and time.monotonic() - t0 < timeout_s:
        time.sleep(poll_s)
        now = held()
    # a model frees a sequence's slot one reaper period after it dropped it: give the last ones that long
    time.sleep(min(2 * poll_s, max(0.0, timeout_s - (time.monotonic() - t0))))
    if now:
        log(f"[s3flow drain] {now} sequences still held {timeout_s:.0f} s after closing")
    return now == 0


def healing_marker(drain_file: str) -> str:
    """The file that stands while the supervisor reloads a model whose stub died (``s3flow.server.healing``)."""
    return f"{drain_file}.healing"


def ready(http_url: str, drain_file: str, metrics_url: str = "") -> bool:
    """The server answers ready, is not draining, and is not reloading a model whose stub died (Triton itself
    answers ready meanwhile, while every request to that model fails); with ``metrics_url`` (``--priced``), its
    solver has also priced its work (its capacity gauge shows: a new server's calibration, about 2 s after Triton
    is ready; a restarted one's saved price at once), so a fleet sends a new pod no burst it cannot judge."""
    if drain_file and (os.path.exists(drain_file) or os.path.exists(healing_marker(drain_file))):
        return False
    try:
        with urllib.request.urlopen(f"{http_url.rstrip('/')}/v2/health/ready", timeout=3) as response:
            if response.status != 200:
                return False
        return not metrics_url or priced(metrics_url)
    except (OSError, urllib.error.URLError):
        return False


#: how long a model may stay dead (its reload failing) before the liveness probe fails (seconds)
HEAL_BOUND_S = 60.0


def live(http_url: str, drain_file: str, heal_bound_s: float = HEAL_BOUND_S) -> bool:
    """The server answers live, and no model has been dead longer than ``heal_bound_s``: the supervisor's healing
    marker (it stands from a stub's death until its model is reloaded) is younger than that. A server that cannot
    heal fails this, and Kubernetes restarts the pod."""
    marker = healing_marker(drain_file) if drain_file else ""
    try:
        if marker and time.time() - os.path.getmtime(marker) > heal_bound_s:
            return False
    except OSError:   # no marker: nothing is being healed
        pass
    try:
        with urllib.request.urlopen(f"{http_url.rstrip('/')}/v2/health/live", timeout=3) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def supervise(command: list[str], drain_file: str, metrics_url: str, deadline_s: float,
              kill_after_s: float = 30.0, heal_http_url: str = "") -> int:
    """Run ``command`` (tritonserver) with ``S3FLOW_DRAIN_FILE`` set; on SIGTERM/SIGINT drain, then SIGTERM it.

    A second signal during the drain stops the server at once; a drain file made before the signal (by a
    Kubernetes preStop hook: that drain is over) stops it at once too. ``kill_after_s`` after its SIGTERM
    the server is killed. ``heal_http_url``: once the server answers ready there, the model of any python stub
    that dies is reloaded (``s3flow.server.healing``; the server must run with explicit model control and every
    model loaded). Returns the server's exit code.
    """
    pathlib.Path(drain_file).unlink(missing_ok=True)  # a drain of an earlier run must not refuse this one
    env = dict(os.environ, **{DRAIN_FILE_ENV: drain_file})
    child = subprocess.Popen(command, env=env)
    signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: signals.append(signum))
    healer = None
    while child.poll() is None and not signals:
        if heal_http_url and healer is None and ready(heal_http_url, ""):
            healer = StubWatch(child.pid, heal_http_url, log=lambda msg: print(f"[s3flow heal] {msg}", flush=True),
                               headers=admin_headers(read_admin_key(), "http"),
                               marker=pathlib.Path(healing_marker(drain_file)))
            healer.start()
        time.sleep(0.1)
    if healer is not None:   # the stubs go with the server now: none may be reloaded
        healer.stop()
    if child.poll() is None:
        if os.path.exists(drain_file):  # a Kubernetes preStop hook drained already: stop now
            print("[s3flow drain] drained before the signal: stopping the server", flush=True)
            drained = True
        else:
            drained = drain(drain_file, metrics_url, deadline_s, log=lambda msg: print(msg, flush=True),
                            give_up=lambda: len(signals) > 1)["drained"]
        if len(signals) < 2:   # past the deadline the open utterances are cut now (they resume elsewhere)
            close(drain_file, metrics_url, timeout_s=10.0 if drained else 1.0, log=lambda msg: print(msg, flush=True))
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(kill_after_s)
        except subprocess.TimeoutExpired:
            print(f"[s3flow drain] the server did not stop {kill_after_s:.0f} s after SIGTERM: killed", flush=True)
            child.kill()
            child.wait(10)
    pathlib.Path(drain_file).unlink(missing_ok=True)
    pathlib.Path(healing_marker(drain_file)).unlink(missing_ok=True)
    remove_server_files(child.pid)   # its /dev/shm folders, and what killed servers before it left there
    remove_stale()
    return child.returncode


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m s3flow.server.drain`` (before its ``--``); defaults read the environment now."""
    parser = argparse.ArgumentParser(prog="python -m s3flow.server.drain", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("supervise", "drain", "ready", "live"))
    parser.add_argument("--drain-file", default=os.environ.get(DRAIN_FILE_ENV, ""),
                        help=f"the drain file (default ${DRAIN_FILE_ENV}; supervise: a fresh temporary path)")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    parser.add_argument("--http-url", default="http://127.0.0.1:8000",
                        help="for ready and live: the server's HTTP endpoint")
    parser.add_argument("--priced", action="store_true",
                        help="ready: also only once the solver has priced its work (its capacity gauge on "
                             "--metrics-url shows): a new pod takes no burst it cannot judge")
    parser.add_argument("--heal-bound-s", type=float, default=HEAL_BOUND_S,
                        help="live: fail once a model has been dead (its reload failing) this long")
    parser.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                        help="how long utterances in flight may take to finish")
    parser.add_argument("--kill-after-s", type=float, default=30.0,
                        help="supervise: SIGKILL the server this long after its SIGTERM")
    parser.add_argument("--heal-http-url", default="",
                        help="supervise: once the server answers ready at this HTTP endpoint, reload the model of "
                             "any python stub that dies (needs --model-control-mode=explicit --load-model=*)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1:]  # supervise: -- the server's command
    if args.what == "supervise":
        if not command:
            parser.error("supervise needs the server's command line after --")
        drain_file = args.drain_file or os.path.join(tempfile.gettempdir(), f"s3flow-drain-{os.getpid()}")
        return supervise(command, drain_file, args.metrics_url, args.deadline_s, args.kill_after_s,
                         args.heal_http_url)
    if not args.drain_file:
        parser.error(f"--drain-file or ${DRAIN_FILE_ENV} is needed")
    if args.what == "drain":
        drain(args.drain_file, args.metrics_url, args.deadline_s)
        return 0
    if args.what == "live":
        return 0 if live(args.http_url, args.drain_file, args.heal_bound_s) else 1
    return 0 if ready(args.http_url, args.drain_file, args.metrics_url if args.priced else "") else 1


if __name__ == "__main__":
    sys.exit(main())
