"""The load test's engine (``scripts/load_test.py`` is its CLI; tests/test_load.py runs short versions).

Phase 1, :func:`run_load`: ``streams`` client threads, each streaming ``utterances`` utterances one after the
other (seeded stand-in tokens, growing chunks), all at once against one server. Every chunk's frames are
checked (:func:`check_chunks`): offsets continue without gap or duplicate, each chunk brings exactly the
frames its tokens made final (2 per token, less the 6 look-ahead frames until END), and the END completes
the utterance with 2 frames per token. Then ``check_outputs`` of the utterances are streamed again alone and
must match what they gave under load within ``OUTPUT_ATOL``. With the server's metrics address, the solver's
histograms over the load are read back (``s3flow.serving.metrics``) and checked against the client's counts.

Phase 2, :func:`run_memory`: short utterances in a row, the solver stub's resident memory sampled as they go.

Example::

    from s3flow_tools.bench.load import run_load, solver_stub_pid
    report = run_load("127.0.0.1:8001", streams=4, utterances=3, stub_pid=solver_stub_pid(server_pid))
    assert report.ok, report.errors
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import psutil

from s3flow.server.healing import stubs
from s3flow.server.metrics_reader import histogram, metric_sum, read_metrics
from s3flow.serving.metrics import HISTOGRAMS

from s3flow_client.demo import demo_utterance
from s3flow_client.state import FRAMES_PER_TOKEN
from s3flow_client.stream import StreamError, StreamingClient, chunk_schedule

from s3flow_contract.tensors import LOOKAHEAD_FRAMES  # noqa: E402  withheld until the next chunk or END
OUTPUT_ATOL = 5e-4       # batched under load vs alone (padding changes float summation order)


# ------------------------------------------------------------------------------ the server's processes
def solver_stub_pid(server_pid: int, model: str = "cfm_solver") -> Optional[int]:
    """PID of the python-backend stub serving ``model`` (``s3flow.server.healing.stubs``: from its command line)."""
    return next((pid for pid, m in stubs(server_pid).items() if m == model), None)


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB."""
    return psutil.Process(pid).memory_info().rss / 2**20




# ------------------------------------------------------------------------------------------ utterances
def load_utterance(index: int, steps: int):
    """Utterance ``index`` of the load: 0.8-2.4 s of tokens, a 0.4-1.0 s prompt, growing chunks."""
    rng = np.random.default_rng(index)
    u = demo_utterance(float(rng.uniform(0.8, 2.4)), seed=1000 + index, noise_seed=index,
                       prompt_seconds=float(rng.uniform(0.4, 1.0)))
    u.chunks = chunk_schedule(len(u.speech_tokens), 6, 2.0, 24)
    u.n_timesteps = steps
    return u


def memory_utterance(index: int, steps: int):
    """A 0.3 s utterance (8 tokens, chunks 4 + 4) with a 0.4 s prompt."""
    u = demo_utterance(0.3, seed=index % 50, noise_seed=index, prompt_seconds=0.4)
    u.chunks, u.n_timesteps = [4, 4], steps
    return u


def check_chunks(u, result, holdback_frames: int = 0) -> Optional[str]:
    """Exact per-chunk frame accounting of one streamed utterance; None if right, else what is wrong.

    (Order and continuity of frame offsets are checked by the client as responses arrive.)
    """
    if len(result.chunk_frames) != len(u.chunks):
        return f"{len(result.chunk_frames)} responses for {len(u.chunks)} chunks"
    tokens = frames = made = 0
    for k, (size, got) in enumerate(zip(u.chunks, result.chunk_frames)):
        tokens += size
        final = k == len(u.chunks) - 1
        made = FRAMES_PER_TOKEN * tokens if final else max(
            FRAMES_PER_TOKEN * tokens - LOOKAHEAD_FRAMES - holdback_frames, made)
        if frames + got != made:
            return f"chunk {k}: {got} frames after {frames}, expected {made - frames} ({tokens} tokens so far)"
        frames += got
    if result.mel.shape[1] != FRAMES_PER_TOKEN * len(u.speech_tokens):
        return f"{result.mel.shape[1]} frames for {len(u.speech_tokens)} tokens"
    if not np.isfinite(result.mel).all():
        return "non-finite mel values"
    return None


# ------------------------------------------------------------------------------------------ phase 1: load
@dataclass
class LoadReport:
    streams: int
    utterances: int
    steps: int
    wall_s: float = 0.0
    done: int = 0
    not_run: int = 0
    errors: list = field(default_factory=list)
    frame_errors: list = field(default_factory=list)
    output_mismatches: list = field(default_factory=list)
    chunk_latencies: list = field(default_factory=list)   # later chunks, seconds
    first_latencies: list = field(default_factory=list)   # first chunk of each utterance
    #: per utterance: seconds a real-time player ran dry (StreamResult.playback_stalls), starting at the first
    #: audio, and with a 0.3 s start-up buffer
    stall_s: list = field(default_factory=list)
    stall_s_buffered: list = field(default_factory=list)
    chunks: int = 0
    audio_s: float = 0.0
    #: admission by capacity: utterances refused (busy) at least once before the server took them, all the busy
    #: answers, and per such utterance the seconds until its START was admitted
    refused: int = 0
    busy_answers: int = 0
    admission_s: list = field(default_factory=list)
    rss_before_mb: Optional[float] = None
    rss_after_mb: Optional[float] = None
    live_after: Optional[float] = None
    #: the solver's histograms over the load phase (s3flow.serving.metrics.HISTOGRAMS): {name: Histogram of the deltas}
    server_histograms: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.errors or self.frame_errors or self.output_mismatches or self.not_run)

    def stalled(self, which: str = "stall_s") -> float:
        """The fraction of utterances whose player ran dry."""
        values = getattr(self, which)
        return sum(v > 0 for v in values) / len(values) if values else float("nan")

    def percentile_ms(self, which: str, q: float) -> float:
        values = getattr(self, which)
        return 1000 * float(np.percentile(values, q)) if values else float("nan")


def run_load(url: str, streams: int, utterances: int, steps: int = 2, time_limit_s: float = 600.0,
             check_outputs: int = 2, stub_pid: Optional[int] = None, metrics_url: Optional[str] = None,
             holdback_frames: int = 0, log=print) -> LoadReport:
    """``streams`` threads x ``utterances`` utterances each; see the module docstring."""
    report = LoadReport(streams, utterances, steps)
    report.rss_before_mb = rss_mb(stub_pid) if stub_pid else None
    results: dict[int, object] = {}
    lock = threading.Lock()
    before = read_metrics(metrics_url) if metrics_url else None
    start = time.monotonic()
    deadline = start + time_limit_s

    def worker(w: int):
        for j in range(utterances):
            index = w * utterances + j
            left = deadline - time.monotonic()
            if left <= 1.0:
                with lock:
                    report.not_run += utterances - j
                return
            u = load_utterance(index, steps)
            client = StreamingClient(url, timeout_s=left, response_timeout_s=min(left, 60.0))
            try:
                [r] = client.synthesize([u])
            except Exception as exc:  # noqa: BLE001 -- counted, never lost: a load test reports every failure
                with lock:
                    report.errors.append(f"utterance {index}: {exc if isinstance(exc, StreamError) else repr(exc)}")
                continue
            bad = check_chunks(u, r, holdback_frames)
            with lock:
                results[index] = r
                report.done += 1
                report.chunks += len(r.chunk_frames)
                report.audio_s += r.audio_s
                report.first_latencies.append(r.chunk_latencies_s[0])
                report.chunk_latencies.extend(r.chunk_latencies_s[1:])
                report.stall_s.append(r.playback_stalls(0.0)[1])
                report.stall_s_buffered.append(r.playback_stalls(0.3)[1])
                busy = sum("disposition=busy" in m for m in r.retries + r.resumes)
                if busy:
                    report.refused += 1
                    report.busy_answers += busy
                    report.admission_s.append(r.admitted_after_s)
                if bad:
                    report.frame_errors.append(f"utterance {index}: {bad}")

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0) + 30)
    report.wall_s = time.monotonic() - start
    if any(t.is_alive() for t in threads):
        report.errors.append(f"client threads still running {report.wall_s:.0f} s after the start")
    log(f"load: {report.done} utterances, {report.chunks} chunks in {report.wall_s:.1f} s; "
        f"{len(report.errors)} errors, {len(report.frame_errors)} frame-accounting errors; {report.refused} "
        f"refused first ({report.busy_answers} busy answers), admitted after "
        f"{max(report.admission_s, default=0.0):.1f} s at most")
    if before is not None:
        report.errors += server_histograms(report, before, settled_metrics(metrics_url, before, report.chunks))

    # the same utterances alone must give what they gave batched under load
    for index in sorted(results)[:check_outputs]:
        u = load_utterance(index, steps)
        try:
            [alone] = StreamingClient(url, timeout_s=120).synthesize([u])
        except StreamError as exc:
            report.errors.append(f"utterance {index} alone: {exc}")
            continue
        err = float(np.abs(alone.mel - results[index].mel).max())
        if not err <= OUTPUT_ATOL:
            report.output_mismatches.append(f"utterance {index}: under load vs alone differ by {err:.2e}")
    report.rss_after_mb = rss_mb(stub_pid) if stub_pid else None
    if metrics_url:
        report.live_after = live_sequences(metrics_url)
    return report


def server_histograms(report: LoadReport, before: dict, after: dict) -> list[str]:
    """Fill ``report.server_histograms`` with what the load phase added to the solver's histograms; return
    what disagrees with the client's own counts (every answered chunk observed once, a first chunk per
    utterance). Only exact when this load is the server's only traffic and nothing failed."""
    problems = []
    for family in HISTOGRAMS:
        h0, h1 = histogram(before, family.name), histogram(after, family.name)
        h1.buckets = {le: v - h0.buckets.get(le, 0.0) for le, v in h1.buckets.items()}
        h1.sum, h1.count = h1.sum - h0.sum, h1.count - h0.count
        report.server_histograms[family.name] = h1
        if not h1.buckets:
            problems.append(f"/metrics has no histogram {family.name}")
    if report.errors or report.not_run:
        return problems
    for name, want in (("s3flow_chunk_seconds", report.chunks), ("s3flow_first_chunk_seconds", report.done)):
        got = report.server_histograms[name].count
        if got != want:
            problems.append(f"{name}_count grew by {got:g} over the load, the client got {want} answers")
    return problems


#: the solver's histograms observed once per answered chunk, in the order it publishes them
PER_CHUNK_HISTOGRAMS = ("s3flow_chunk_seconds", "s3flow_chunk_nfe", "s3flow_chunk_frames")


def settled_metrics(metrics_url: str, before: dict, chunks: int, settle_s: float = 3.0) -> dict:
    """``/metrics`` once each of the solver's per-chunk histograms shows ``chunks`` more answered chunks than
    ``before`` (they are published by a thread of their own, a few ms after each answer and one after the other:
    ``TritonMetrics``; waiting for the first alone once read the last chunk's evaluations missing under two pytest
    workers), or as they are after ``settle_s``."""
    end = time.monotonic() + settle_s
    while True:
        after = read_metrics(metrics_url)
        grown = min(metric_sum(after, f"{name}_count") - metric_sum(before, f"{name}_count")
                    for name in PER_CHUNK_HISTOGRAMS)
        if grown >= chunks or time.monotonic() > end:
            return after
        time.sleep(0.05)


def live_sequences(metrics_url: str, settle_s: float = 5.0) -> float:
    """The solver's live-sequence gauge, after waiting up to ``settle_s`` for it to reach 0."""
    end = time.monotonic() + settle_s
    while True:
        live = metric_sum(read_metrics(metrics_url), "s3flow_live_sequences")
        if live == 0 or time.monotonic() > end:
            return live
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------ phase 2: memory
@dataclass
class MemoryReport:
    utterances: int
    warmup: int
    steps: int
    model: str = "token2mel"
    samples: list = field(default_factory=list)   # (utterances done, {stub: RSS MiB})
    wall_s: float = 0.0
    errors: list = field(default_factory=list)
    live_after: Optional[float] = None

    @property
    def stubs(self) -> list:
        return list(self.samples[0][1]) if self.samples else []

    def start_mb(self, stub: str = "cfm_solver") -> float:
        return self.samples[0][1][stub]

    def end_mb(self, stub: str = "cfm_solver") -> float:
        return self.samples[-1][1][stub]

    def growth(self, stub: str = "cfm_solver") -> float:
        """The run's growth by the samples' robust trend (Siegel's repeated medians: for each sample the median of
        its slopes to the others, then the median of those, over the utterances run). A leak climbs sample after
        sample; neither one sample's noise (+-1.5 MiB between neighbours of a flat run made the end less the start
        fail a 2 MiB bound at 2.008; samples alternating by 1.5 MiB) nor a one-time first-use step decides it (+5
        MiB between the first two samples, flat after: a least-squares line read +2.77; +2.4 MiB between the
        second and the third under two pytest workers: the median of every two samples' slopes read +2.39)."""
        if len(self.samples) < 2:
            return 0.0
        done = np.array([n for n, _ in self.samples], float)
        rss = np.array([m[stub] for _, m in self.samples], float)
        slopes = (rss[None, :] - rss[:, None]) / np.where(np.eye(len(done), dtype=bool), np.nan,
                                                           done[None, :] - done[:, None])
        slope = np.median(np.nanmedian(slopes, axis=1))
        return float(slope * (done[-1] - done[0]))

    def peak_growth(self, stub: str = "cfm_solver") -> float:
        return max(s[1][stub] for s in self.samples) - self.start_mb(stub)

    @property
    def growth_mb(self) -> float:
        """The largest growth over the stubs watched."""
        return max(self.growth(s) for s in self.stubs)


def run_memory(url: str, stubs: dict, utterances: int, steps: int = 1, warmup: int = 50,
               samples: int = 10, metrics_url: Optional[str] = None, log=print,
               model: str = "token2mel") -> MemoryReport:
    """``warmup`` utterances through ``model``, then each stub's RSS (``stubs``: name -> PID); then
    ``utterances`` in a row, the RSS sampled ``samples`` times."""
    report = MemoryReport(utterances, warmup, steps, model)
    client = StreamingClient(url, model, timeout_s=60, response_timeout_s=30)
    every = max(utterances // max(samples, 1), 1)
    rss = lambda: {name: rss_mb(pid) for name, pid in stubs.items()}  # noqa: E731
    start = time.monotonic()
    for i in range(-warmup, utterances):
        if i == 0:
            report.samples.append((0, rss()))
            start = time.monotonic()
        u = memory_utterance(i + warmup, steps)
        try:
            [r] = client.synthesize([u])
            bad = check_chunks(u, r)
            if bad:
                report.errors.append(f"utterance {i}: {bad}")
        except StreamError as exc:
            report.errors.append(f"utterance {i}: {exc}")
        if i >= 0 and (i + 1) % every == 0:
            report.samples.append((i + 1, rss()))
    report.wall_s = time.monotonic() - start
    if metrics_url:
        report.live_after = live_sequences(metrics_url)
    rows = "; ".join(f"{s} RSS {report.start_mb(s):.2f} -> {report.end_mb(s):.2f} MiB (peak growth "
                     f"{report.peak_growth(s):+.2f})" for s in report.stubs)
    log(f"memory: {utterances} utterances through {model} in {report.wall_s:.1f} s; {rows}; "
        f"{len(report.errors)} errors")
    return report
