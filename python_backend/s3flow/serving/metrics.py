"""The solver's Prometheus metrics: their names, kinds and buckets, what is observed, and reading them back.

No Triton import here: ``s3flow.serving.triton_models.cfm_solver`` publishes what :class:`SolverBook` observes through
the python backend's metric API (``pb_utils.MetricFamily``), and the tests and ``scripts/load_test.py``
read ``/metrics`` back with :func:`read_metrics` (prometheus_client's parser). The metrics and example
alert rules are documented in ``docs/operations.md``.

============================================  =========  ===============================================
metric (labels ``model``, ``instance``)       kind       what
============================================  =========  ===============================================
``s3flow_live_sequences``                     gauge      sequences whose state the instance holds
``s3flow_sequences_dropped_total{reason}``    counter    states dropped before their END, by reason
``s3flow_chunk_seconds``                      histogram  per answered chunk: seconds in the solver's
                                                         ``execute`` (encoder + Euler loop); Triton's
                                                         queue time is ``nv_inference_queue_duration_us``
``s3flow_first_chunk_seconds``                histogram  the same, START chunks only
``s3flow_chunk_nfe``                          histogram  network evaluations per chunk (Euler steps, x2
                                                         with classifier-free guidance)
``s3flow_chunk_frames``                       histogram  mel frames a chunk made final (returned)
``s3flow_step_batch_size``                    histogram  sequences solved together in one Euler step
============================================  =========  ===============================================

Example::

    book = SolverBook(publish=lambda name, value, labels: ...)
    book.instrument(engine)             # a StreamingEngine: its run() and estimator are observed
    t0 = book.begin()
    engine.run(chunks)                  # (inside SolverSession.handle)
    book.end(t0)                        # chunk latencies of the chunks that were answered
"""
from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional

#: Latency buckets (seconds): a chunk takes about 10 ms (small model, GPU) to 10 s (full size, CPU).
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
NFE_BUCKETS = (1, 2, 4, 8, 10, 16, 20, 32, 50, 100)
FRAMES_BUCKETS = (0, 10, 25, 50, 100, 200, 400, 800, 1600, 3200)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


@dataclass(frozen=True)
class Family:
    name: str
    kind: str                  # "gauge" | "counter" | "histogram"
    description: str
    buckets: tuple = ()


LIVE = Family("s3flow_live_sequences", "gauge", "sequences whose state the solver instance holds")
DROPPED = Family("s3flow_sequences_dropped_total", "counter",
                 "sequence states dropped before their END, by reason (idle, cancelled, error, ...)")
CHUNK_SECONDS = Family("s3flow_chunk_seconds", "histogram",
                       "seconds a chunk spent in the solver's execute (encoder and Euler loop)", SECONDS_BUCKETS)
FIRST_CHUNK_SECONDS = Family("s3flow_first_chunk_seconds", "histogram",
                             "seconds a START chunk spent in the solver's execute", SECONDS_BUCKETS)
CHUNK_NFE = Family("s3flow_chunk_nfe", "histogram",
                   "network (estimator) evaluations per chunk: Euler steps, x2 with guidance", NFE_BUCKETS)
CHUNK_FRAMES = Family("s3flow_chunk_frames", "histogram", "mel frames a chunk made final", FRAMES_BUCKETS)
STEP_BATCH = Family("s3flow_step_batch_size", "histogram", "sequences solved together in one Euler step",
                    BATCH_BUCKETS)

FAMILIES = (LIVE, DROPPED, CHUNK_SECONDS, FIRST_CHUNK_SECONDS, CHUNK_NFE, CHUNK_FRAMES, STEP_BATCH)
HISTOGRAMS = tuple(f for f in FAMILIES if f.kind == "histogram")

Publish = Callable[[Family, float, dict], None]


def drop_reason(reason: str) -> str:
    """The ``reason`` label of a drop: the text before any ':' detail (a small, fixed set of values)."""
    return reason.split(":")[0]


def nfe(n_steps: int, guidance_rate: float) -> int:
    """Network evaluations of one chunk's solve: ``n_steps``, twice over with classifier-free guidance
    (the conditional and the unconditional half of the 2B call; meanflow runs unguided, rate 0)."""
    return int(n_steps) * (2 if guidance_rate else 1)


def step_sequences(spks) -> int:
    """Sequences in one estimator call: its rows less the unconditional rows of classifier-free guidance,
    which are the rows whose ``spks`` are all zero (a real speaker's ``spks`` never are).

    spks: (rows, n_feats) torch tensor.
    """
    rows = int(spks.shape[0])
    if rows % 2:
        return rows
    unconditional = int((spks[rows // 2:] == 0).all(dim=1).sum())
    return rows - unconditional if unconditional == rows // 2 else rows


class SolverBook:
    """What the solver observes per ``execute``: the chunks its engine answered and its Euler steps.

    ``publish(family, value, labels)`` receives each observation (histograms) or increment (the counter);
    ``labels`` holds the labels beyond model and instance (``reason`` of a drop).
    """

    def __init__(self, publish: Publish, clock: Callable[[], float] = time.perf_counter):
        self.publish, self.clock = publish, clock
        self._pending: list[tuple[bool, int, int]] = []   # (START, nfe, frames) of answered chunks

    def instrument(self, engine) -> None:
        """Observe ``engine`` (a ``StreamingEngine``): wrap its ``run`` (answered chunks) and its estimator
        callable (sequences per Euler step). The engine's behaviour is unchanged."""
        run, estimator = engine.run, engine.estimator

        def observed_run(chunks, on_step=None):
            results = run(chunks, on_step=on_step)
            for c, r in zip(chunks, results):
                self._pending.append((bool(c.new), nfe(c.state.n_steps, c.state.guidance_rate),
                                      int(r.mel.shape[1])))
            return results

        def observed_estimator(x, mask, mu, t, spks, cond, r=None):
            self.publish(STEP_BATCH, step_sequences(spks), {})
            return estimator(x, mask, mu, t, spks, cond, r)

        engine.run, engine.estimator = observed_run, observed_estimator

    def begin(self) -> float:
        """Call at the start of ``execute``; returns the start time for :meth:`end`."""
        self._pending = []
        return self.clock()

    def end(self, started: float) -> int:
        """Call when ``execute``'s responses are ready: publish each answered chunk's latency (its batch's
        time in ``execute``), NFE and frames. Returns the number of chunks observed."""
        seconds = self.clock() - started
        for new, n, frames in self._pending:
            self.publish(CHUNK_SECONDS, seconds, {})
            if new:
                self.publish(FIRST_CHUNK_SECONDS, seconds, {})
            self.publish(CHUNK_NFE, n, {})
            self.publish(CHUNK_FRAMES, frames, {})
        count, self._pending = len(self._pending), []
        return count

    def dropped(self, reason: str) -> None:
        self.publish(DROPPED, 1, {"reason": drop_reason(reason)})


# ------------------------------------------------------------------------------------------ reading back
def parse_metrics(text: str, prefix: str = "s3flow_") -> dict:
    """Prometheus text as {(sample name, ((label, value), ...)): value}, samples whose name starts with
    ``prefix`` (histograms give ``<name>_bucket`` with ``le``, ``<name>_sum``, ``<name>_count``; the parser
    names every counter's samples ``<name>_total``, also Triton's, whose text has no such suffix)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def read_metrics(metrics_url: str, prefix: str = "s3flow_", timeout_s: float = 5.0) -> dict:
    """:func:`parse_metrics` of ``http://<metrics_url>/metrics`` (``metrics_url``: host:port, or a URL)."""
    url = metrics_url if "://" in metrics_url else f"http://{metrics_url}/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse_metrics(response.read().decode(), prefix)


def metric_sum(metrics: dict, name: str, **labels: str) -> float:
    """Sum of sample ``name`` over every label set that has the given labels."""
    return sum(v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= set(ls))


@dataclass
class Histogram:
    """One histogram summed over instances: cumulative ``buckets`` {le: count}, ``sum``, ``count``."""
    buckets: dict
    sum: float
    count: float

    def quantile(self, q: float) -> Optional[float]:
        """The upper bound of the bucket holding quantile ``q`` (as PromQL's histogram_quantile bounds it)."""
        if not self.count:
            return None
        for le in sorted(self.buckets):
            if self.buckets[le] >= q * self.count:
                return le
        return float("inf")


def histogram(metrics: dict, name: str, **labels: str) -> Histogram:
    """Histogram ``name`` from :func:`parse_metrics`' output, summed over the label sets matching ``labels``."""
    buckets: dict = {}
    for (n, ls), v in metrics.items():
        d = dict(ls)
        if n == f"{name}_bucket" and set(labels.items()) <= set(ls):
            le = float(d["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    return Histogram(buckets, metric_sum(metrics, f"{name}_sum", **labels),
                     metric_sum(metrics, f"{name}_count", **labels))
