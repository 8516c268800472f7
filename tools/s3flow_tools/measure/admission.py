"""Admission by capacity under overload, measured (issues 34, 39): who is admitted, how fast the others hear
"busy", how close the server's own capacity estimate stays to the C it really has, and that nothing is lost.

Example::

    .venv/bin/python -m s3flow_tools.measure.admission                 # -> its section of results/qos.md (~30 min)
    .venv/bin/python -m s3flow_tools.measure.admission --model token2mel --loads 3 --no-pair --singles 20 \
        --lost-runs 1 --out /tmp/adm.md

The trained small teacher (``checkpoints/trained``), two repositories alike but for ``utilization_target``:
``0`` (no admission by capacity: the server takes every START it has a slot for) and the default ``0.9``.

1. **C**: on the server without the check, ``--at-once`` held-out sentences (3-6 s, their own prompts) started
   together: seconds of audio per second of wall time, the median of three such bursts. Then, on a fresh server of the same repository, the
   **estimate over a run**:
   idle, 1 stream, 16 at once, idle, 3 at once, 10 utterances one after another, idle, with the gauge
   ``s3flow_capacity_audio_seconds_per_second`` (the ensemble's) read every 0.5 s: each sample against C, and
   a picture of both over time beside the streams held (``results/qos_capacity_<model>.png``); and **lost at
   overload**: 16 and 32 at once, ``--lost-runs`` times each, accepted utterances lost.
2. **Loads** k C at once (k in ``--loads``): round(k C) plain ``StreamingClient`` s, one utterance each, no retry
   (a refusal comes back to the caller): admitted and refused, the admitted streams' stalls behind a real-time
   player with a 0.3 s start-up buffer and first audio, each refusal's answer time from the START's send (the
   server's; and the client's whole call, its own start-up of a hundred threads in one process too) and its
   ``retry_after``, accepted utterances lost; the server's own capacity estimate
   (``s3flow_capacity_audio_seconds_per_second``); tritonserver's and its stubs' summed RSS before and 30 s after.
   Then each load again on a **fresh server**, right after it is ready (a restart: its solver instances priced by
   what the last server from this repository measured, ``s3flow.serving.saved_price``), and on a **new server**
   (nothing saved: its calibration runs once it is ready, and a START waits for it: issue 48's burst that went in
   unpriced); and a client **killed** after 2 answered chunks followed by one healthy utterance (the killed one's
   stream is held until the idle timeout: is the healthy one served?).
3. **Singles** on the server with the check: ``--singles`` utterances one after another with random gaps of
   0-1 s: how many STARTs were answered busy (an idle server takes every one).
4. **Two servers** (``--pair``), each pinned to one core (``taskset``): C of one pinned server alone, then 2 C
   offered in all to the client's URL list [A, B] (one retry and one resume, so a busy A sends a START on to B):
   refusals that reached the caller, and of those, how many the other server had not refused too.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from s3flow_contract.tensors import FRAMES_PER_SECOND
from s3flow.repository import cli as build_repository
from s3flow.server.metrics_reader import metric_sum, read_metrics, wait_priced
from s3flow.server.processes import tree_pids
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.stream import StreamError
from s3flow_contract.answers import answer_of
from s3flow_tools.bench.report import machine
from s3flow_tools.measure.corpus import TRAINED, utterances   # the same held-out sentences as the scheduler's table
from s3flow_tools.bench.killed_client import kill_mid_stream
from s3flow_tools.measure.command import command
from s3flow_tools.measure.sections import write_section

ROOT = Path(__file__).resolve().parents[3]

BUFFER_S = 0.3
#: single utterances in the traced run (issue 39's: idle, 1, 16 at once, idle, 3 at once, 10 singles, idle)
TRACE_SINGLES = 10
C_BURSTS = 3   # C is the median of this many bursts of ``--at-once`` streams


def build(repo: Path, target: float, flags: tuple = ()) -> None:
    """The repository as ``make demo`` builds it, at utilization target ``target``, with more build ``flags``."""
    if build_repository.main(["--checkpoint", str(TRAINED / "teacher.safetensors"), "--vocoder-checkpoint",
                              str(TRAINED / "vocoder.safetensors"), "--output", str(repo), "--no-voice",
                              "--utilization-target", str(target), *flags]) != 0:
        raise SystemExit("building the repository failed")


def burst(urls: list[str], model: str, n: int, retries: int = 0, offset: int = 0,
          voices: Optional[dict] = None) -> tuple[list, float]:
    """n clients at once, one utterance each; per client (result or None, error message or None). ``voices``
    ({sentence's prompt bytes: its registered ``Voice``}, ``s3flow_tools.measure.at_once.register``): each
    starts by its voice id."""
    utts = utterances(n, offset)
    if voices is not None:
        utts = [voices[u.prompt_tokens.tobytes()].utterance(u.speech_tokens, seed=u.seed) for u in utts]
    out: list = [None] * n
    t0 = time.monotonic()

    def one(k):
        client = StreamingClient(urls, model, timeout_s=300, max_retries=retries, max_resumes=retries)
        try:
            [r] = client.synthesize([utts[k]])
            out[k] = (r, None)
        except StreamError as exc:
            out[k] = (exc.results[0], str(exc))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.monotonic() - t0


def throughput(urls: list[str], model: str, n: int, voices: Optional[dict] = None) -> tuple[float, list]:
    """C: audio seconds per wall second of n streams at once; and the errors of those that failed (reported:
    without the check, an overloaded server may lose some)."""
    out, wall = burst(urls, model, n, voices=voices)
    return sum(r.mel.shape[1] for r, e in out if e is None) / FRAMES_PER_SECOND / wall, [e for _, e in out if e]


def settle(server: TritonServer, timeout_s: float = 30.0) -> None:
    """Until the server holds no sequence (the last ENDs answered, the idle ones reaped)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if metric_sum(read_metrics(f"127.0.0.1:{server.metrics_port}"), "s3flow_live_sequences") == 0:
            return
        time.sleep(0.5)


def capacity_estimate(server: TritonServer, model: str = "token2mel") -> float:
    return metric_sum(read_metrics(f"127.0.0.1:{server.metrics_port}"), "s3flow_capacity_audio_seconds_per_second",
                      ensemble=model)


def calibrated(server: TritonServer, timeout_s: float = 60.0) -> TritonServer:
    """Once the solver's calibration at load is over (its capacity estimate shows): it must not share the cores
    with what is measured."""
    wait_priced(f"127.0.0.1:{server.metrics_port}", timeout_s=timeout_s)
    return server


class GaugeTrace:
    """The ensemble's capacity gauge and the streams held, read every ``period_s`` on a thread; phases marked."""

    def __init__(self, server: TritonServer, model: str, period_s: float = 0.5):
        self.server, self.model, self.period_s = server, model, period_s
        self.samples: list = []       # (t, estimate, live)
        self.phases: list = []        # (t, label)
        self._stop, self.t0 = threading.Event(), time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "GaugeTrace":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def phase(self, label: str) -> None:
        self.phases.append((time.monotonic() - self.t0, label))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                m = read_metrics(f"127.0.0.1:{self.server.metrics_port}")
            except OSError:
                continue
            self.samples.append((time.monotonic() - self.t0, metric_sum(
                m, "s3flow_capacity_audio_seconds_per_second", ensemble=self.model),
                metric_sum(m, "s3flow_live_sequences")))


def singles(url: str, model: str, n: int, seed: int = 0) -> list:
    """``n`` utterances one after another, a random 0-1 s gap before each, no retry; (result, error) each."""
    rng, out = np.random.default_rng(seed), []
    for k in range(n):
        time.sleep(float(rng.uniform(0.0, 1.0)))
        o, _ = burst([url], model, 1, offset=31 + k)
        out += o
    return out


def estimate_run(server: TritonServer, model: str, c: float, singles_n: int) -> tuple:
    """The run of issue 39 (module docstring, 1.) with the gauge traced: (trace, first utterance's end)."""
    with GaugeTrace(server, model) as trace:
        for label, action in (("idle", lambda: time.sleep(3)), ("1 stream", lambda: burst([server.grpc_url], model, 1)),
                              ("16 at once", lambda: burst([server.grpc_url], model, 16, offset=3)),
                              ("idle", lambda: time.sleep(5)),
                              ("3 at once", lambda: burst([server.grpc_url], model, 3, offset=7)),
                              (f"{singles_n} singles", lambda: singles(server.grpc_url, model, singles_n, seed=1)),
                              ("idle", lambda: time.sleep(5))):
            trace.phase(label)
            action()
            if label == "1 stream":
                first_end = time.monotonic() - trace.t0
    return trace, first_end


def plot_trace(trace: GaugeTrace, c: float, model: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] for s in trace.samples]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.plot(t, [s[1] for s in trace.samples], label="the server's estimate (gauge)", color="tab:blue", zorder=3)
    ax.axhline(c, color="black", lw=1, label=f"C measured (16 at once, no admission): {c:.2f}")
    ax.axhspan(0.75 * c, 1.25 * c, color="0.9", label="C +- 25 %")
    ax.set_ylabel("audio s per s")
    ax.set_xlabel("s")
    right = ax.twinx()
    right.step(t, [s[2] for s in trace.samples], where="post", color="tab:orange", alpha=0.6, lw=1,
               label="streams held")
    right.set_ylabel("streams held")
    for when, label in trace.phases:
        ax.axvline(when, color="0.6", lw=0.6, ls=":")
        ax.text(when, ax.get_ylim()[1], label, fontsize=7, rotation=90, va="top")
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title(f"{model}: capacity estimate over a run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_row(label: str, out: list, model: str) -> dict:
    admitted = [r for r, e in out if e is None]
    refused = [(r, e) for r, e in out if e is not None and "disposition=busy" in e]
    lost = [e for _, e in out if e is not None and "disposition=busy" not in e]
    first = [r.first_audio_s if model == "token2wav" else r.first_chunk_s for r in admitted]
    stalls = [r.playback_stalls(BUFFER_S) for r in admitted]
    answer_ms = [1000 * r.error_after_s for r, _ in refused]   # from the START's send: the server's time
    call_ms = [1000 * r.wall_s for r, _ in refused]            # the client's whole call (its own start-up too)
    retry_after = [answer_of(e).retry_after_s for _, e in refused]
    return {"label": label, "n": len(out), "admitted": len(admitted), "refused": len(refused), "lost": lost,
            "stalled": sum(s[0] > 0 for s in stalls), "stall_p95": float(np.percentile([s[1] for s in stalls], 95))
            if stalls else 0.0, "first_p95": 1000 * float(np.percentile(first, 95)) if first else float("nan"),
            "answer_p99": float(np.percentile(answer_ms, 99)) if answer_ms else float("nan"),
            "answer_max": max(answer_ms, default=float("nan")),
            "call_p99": float(np.percentile(call_ms, 99)) if call_ms else float("nan"),
            "retry_after": (min(retry_after), max(retry_after)) if retry_after else None}


def load_at_once(server: TritonServer, model: str, k: float, c: float, label: str) -> dict:
    """round(k C) plain clients at once, no retry: their row (``load_row``), printed."""
    n = max(1, round(k * c))
    out, _ = burst([server.grpc_url], model, n, offset=11)
    r = load_row(label, out, model)
    print(f"  {label}: {n} streams, {r['admitted']} admitted, {r['refused']} refused (answer max "
          f"{r['answer_max']:.0f} ms), {len(r['lost'])} lost, {r['stalled']} stalled", flush=True)
    return r


def pin(server: TritonServer, core: int) -> None:
    """Every thread of the server and its stubs on one core."""
    for pid in tree_pids(server.pid):
        subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], check=False, capture_output=True)


def measure_model(model: str, loads: list[float], at_once: int, repos: dict, tmp: Path, pair: bool,
                  singles_n: int, lost_runs: int, pictures: Path) -> list[str]:
    lines = [f"### `{model}`", ""]
    with TritonServer(repos["off"], log_file=tmp / f"{model}-off.log") as server:
        calibrated(server)
        burst([server.grpc_url], model, 2)   # warm the client path
        # C from one burst moved 6.96 -> 10.17 between two runs of the same code: the median of C_BURSTS
        runs = [throughput([server.grpc_url], model, at_once) for _ in range(C_BURSTS)]
        c, c_lost = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        print(f"{model}: C = {c:.2f} s of audio per second, the median of {', '.join(f'{r[0]:.2f}' for r in runs)} "
              f"({len(c_lost)} of {at_once} lost in it)", flush=True)
    with TritonServer(repos["off"], log_file=tmp / f"{model}-trace.log") as server:   # a fresh server's estimate
        calibrated(server)
        trace, first_end = estimate_run(server, model, c, TRACE_SINGLES)
        lost = {}
        for n in (16, 32):
            for _ in range(lost_runs):
                _, errors = throughput([server.grpc_url], model, n)
                lost.setdefault(n, []).append(len(errors))
                settle(server)
        print(f"  lost at overload: {lost}", flush=True)
    picture = pictures / f"qos_capacity_{model}.png"
    pictures.mkdir(parents=True, exist_ok=True)
    plot_trace(trace, c, model, picture)
    after = [s[1] for s in trace.samples if s[0] >= first_end]
    ratios = [e / c for e in after]
    inside = sum(0.75 <= r <= 1.25 for r in ratios)
    rows = []
    with TritonServer(repos["on"], log_file=tmp / f"{model}-on.log") as server:
        calibrated(server)
        burst([server.grpc_url], model, 1)
        settle(server)
        estimate = capacity_estimate(server, model)
        rss_before = server.rss_bytes()
        for k in loads:
            rows.append(load_at_once(server, model, k, c, f"{k:g} C at once"))
            settle(server)
        # a client killed after 2 answered chunks (its stream held until the idle timeout), then a healthy one
        kill_mid_stream(server.grpc_url, model, seed=5, seconds=5.0, answers=2)
        [(healthy_after_kill, healthy_error)], _ = burst([server.grpc_url], model, 1, offset=41)
        print(f"  killed client, then one: {'served' if healthy_error is None else healthy_error[:200]}", flush=True)
        settle(server)
        one_by_one = singles(server.grpc_url, model, singles_n, seed=2)
        busy_singles = sum(1 for _, e in one_by_one if e is not None and "disposition=busy" in e)
        other_singles = sum(1 for _, e in one_by_one if e is not None and "disposition=busy" not in e)
        print(f"  {singles_n} singles: {busy_singles} busy, {other_singles} other errors", flush=True)
        time.sleep(30.0)
        rss_after = server.rss_bytes()
        healthy = server.client().is_server_ready()
    for k in loads:   # each load again on a fresh server: right after it is ready, its price the last server's here
        with TritonServer(repos["on"], log_file=tmp / f"{model}-fresh-{k:g}.log") as server:
            rows.append(load_at_once(server, model, k, c, f"{k:g} C at once, fresh server"))
    for k in loads:   # and on a new one (nothing saved: a first start on this host): it waits for its calibration
        shutil.rmtree(repos["on"] / "cfm_solver" / "price", ignore_errors=True)
        with TritonServer(repos["on"], log_file=tmp / f"{model}-new-{k:g}.log") as server:
            rows.append(load_at_once(server, model, k, c, f"{k:g} C at once, new server"))
    lines += [f"C (without the check, {at_once} at once): **{c:.2f}** s of audio per second; the server's own estimate "
              f"(`s3flow_capacity_audio_seconds_per_second`, after its calibration): {estimate:.2f} "
              f"({estimate / c:.2f}x). Target utilization 0.9." + (
                  f" **Without the check, {len(c_lost)} of the {at_once} streams were lost** (first: "
                  f"`{c_lost[0][:200]}`)." if c_lost else ""), "",
              f"| load | streams | admitted | refused | admitted that stalled ({BUFFER_S} s buffer) | stall s p95 | "
              f"first {'audio' if model == 'token2wav' else 'mel'} p95 (ms) | refusal answer p99 / max (ms) | "
              f"refusal call p99 (ms) | retry_after (s) | accepted lost |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ra = "-" if r["retry_after"] is None else f"{r['retry_after'][0]:.1f}-{r['retry_after'][1]:.1f}"
        lines.append(f"| {r['label']} | {r['n']} | {r['admitted']} | {r['refused']} | {r['stalled']} / {r['admitted']} | "
                     f"{r['stall_p95']:.2f} | {r['first_p95']:.0f} | {r['answer_p99']:.0f} / {r['answer_max']:.0f} | "
                     f"{r['call_p99']:.0f} | {ra} | {len(r['lost'])} |")
    lines += ["", f"The estimate over a run on a fresh server without the check (idle, 1 stream, 16 at once, idle, 3 at "
                  f"once, {TRACE_SINGLES} singles, idle; read every 0.5 s; [picture]({picture.name})): from the end of the "
                  f"first utterance on, **{inside} of {len(ratios)} samples within +-25 % of C**, from "
                  f"{min(ratios, default=float('nan')):.2f}x to {max(ratios, default=float('nan')):.2f}x C (before "
                  f"any stream, the calibrated prior: {trace.samples[0][1] / c:.2f}x).", "",
              "Admission off, accepted utterances lost: " + ", ".join(
                  f"{n} at once {'/'.join(str(x) for x in v)} (of {n}, {len(v)} runs)" for n, v in lost.items()) + ".",
              "",
              f"A client killed after 2 answered chunks of a 5 s utterance (its stream held until the idle timeout), "
              f"then one healthy utterance: **{'served' if healthy_error is None else 'refused: ' + healthy_error[:160]}**.",
              "",
              f"{singles_n} single utterances one after another, random gaps of 0-1 s, admission on: "
              f"**{busy_singles} answered busy**, {other_singles} other errors.", "",
              f"![capacity estimate over a run]({picture.name})", ""]
    lines += ["", f"Memory (tritonserver and its stubs): {rss_before / 2**20:.0f} MiB before the loads, "
                  f"{rss_after / 2**20:.0f} MiB 30 s after ({100 * (rss_after / rss_before - 1):+.1f} %); the server "
                  f"{'answered ready' if healthy else 'was NOT ready'} after them.", ""]
    for r in rows:
        for e in r["lost"][:3]:
            lines.append(f"- lost at {r['label']}: {e[:300]}")
    if pair:
        lines += measure_pair(model, repos, tmp)
    return lines


def measure_pair(model: str, repos: dict, tmp: Path) -> list[str]:
    with TritonServer(repos["off"], log_file=tmp / f"{model}-c.log") as alone:   # C of one pinned server
        pin(alone, 0)
        calibrated(alone)
        burst([alone.grpc_url], model, 1)
        c, _ = throughput([alone.grpc_url], model, 8)
    with TritonServer(repos["on"], log_file=tmp / f"{model}-a.log") as a, \
            TritonServer(repos["on"], log_file=tmp / f"{model}-b.log") as b:
        pin(a, 0)
        pin(b, 1)
        calibrated(a)
        calibrated(b)
        burst([a.grpc_url], model, 1)
        burst([b.grpc_url], model, 1)
        settle(a)
        settle(b)
        n = max(2, round(2 * c))
        out, _ = burst([a.grpc_url, b.grpc_url], model, n, retries=1, offset=23)
    admitted = [r for r, e in out if e is None]
    refused = [(r, e) for r, e in out if e is not None and "disposition=busy" in e]
    lost = [e for _, e in out if e is not None and "disposition=busy" not in e]
    # a refusal reached the caller while the other server had room when that server never refused it
    one_sided = [e for r, e in refused if not (a.grpc_url in " ".join(r.retries + r.resumes + [e])
                                                 and b.grpc_url in " ".join(r.retries + r.resumes + [e]))]
    on_b = sum(any(b.grpc_url in m for m in r.resumes) for r in admitted)
    print(f"  pair: C one pinned server {c:.2f}; {n} offered, {len(admitted)} admitted ({on_b} on B), "
          f"{len(refused)} refused, {len(one_sided)} of them by one server only", flush=True)
    return ["", f"Two servers, each pinned to one core (`taskset`); C of one of them alone (8 at once): {c:.2f} s of "
                f"audio per second; {n} streams (2 C) offered at once to the URL list [A, B]: **{len(admitted)} "
                f"admitted** ({on_b} sent on to B by A's busy answer), {len(refused)} refusals reached the caller, "
                f"**{len(one_sided)} of them while the other server had not refused** (had room), {len(lost)} "
                f"accepted lost.", ""]


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--model", default="both", choices=("token2mel", "token2wav", "both"))
    p.add_argument("--loads", default="1.5,3,10", help="streams at once in units of C (%(default)s)")
    p.add_argument("--at-once", type=int, default=16, help="streams that measure C (%(default)s)")
    p.add_argument("--pair", action=argparse.BooleanOptionalAction, default=True,
                   help="also the two pinned servers (%(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "qos.md",
                   help="the file whose admission section is (re)written (default: %(default)s)")
    p.add_argument("--singles", type=int, default=100, help="utterances one after another (%(default)s)")
    p.add_argument("--lost-runs", type=int, default=3, help="runs of 16 and of 32 at once (%(default)s)")
    p.add_argument("--flags", default="", help="more build_repository flags for both repositories (e.g. "
                                               "'--keep-solved 2': every frame solved once, issue 50)")
    args = p.parse_args(argv)
    loads = [float(x) for x in args.loads.split(",")]
    models = ("token2mel", "token2wav") if args.model == "both" else (args.model,)
    lines = ["## Admission by capacity (issues 34, 39)", "",
             f"Made by `python -m s3flow_tools.measure.admission{' --flags ' + repr(args.flags) if args.flags else ''}` on "
             f"{', '.join(f'{k} {v}' for k, v in machine().items())}: the "
             f"trained small teacher (10 guided steps), held-out sentences of 3-6 s with their own prompts, `fifo`, "
             f"each stream a plain `StreamingClient` with no retry (a refusal reaches the caller); loads in units of "
             f"the C measured in the same run on the same repository without the check.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        repos = {"off": tmp / "off", "on": tmp / "on"}
        build(repos["off"], 0.0, tuple(args.flags.split()))
        build(repos["on"], 0.9, tuple(args.flags.split()))
        for model in models:
            lines += measure_model(model, loads, args.at_once, repos, tmp, args.pair, args.singles, args.lost_runs,
                                   args.out.parent)
            write_section(args.out, "admission", lines)   # what is measured so far
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
