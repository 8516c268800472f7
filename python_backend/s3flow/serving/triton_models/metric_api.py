"""Publishing ``s3flow.serving.metrics`` families through the python backend's metric API (``pb_utils``).

One ``TritonMetrics`` per model instance: labels ``model`` and ``instance`` on every series, more per call
(``reason`` of a drop). A family with no more labels is made at once, at 0: a series that first appears already
counting hides its first increments from Prometheus's rate() (seen: first audio p95 NaN after a load). A family
the stub cannot make (no custom metrics, or no HISTOGRAM) is left out; the others still publish. Thread-safe (the solver's execute and its idle reaper both publish).

Each observation is a round trip to Triton (about 0.2-0.3 ms on the 2-core host): the solver's per-step and
per-chunk histograms, published where they happen, took 14 % of its Python (py-spy, one stream at a time). Families
named ``background`` are published by a thread of their own, off the step loop's path (they reach ``/metrics`` a
few ms later); the others (gauges, counters: what a test or an operator reads right after a fault) at once.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterable

from s3flow.serving.metrics import Family
from s3flow.serving.triton_models.base import pb_utils


class TritonMetrics:
    def __init__(self, families: Iterable[Family], model: str, instance: str, background: Iterable[Family] = ()):
        self.labels = {"model": model, "instance": instance}
        self._lock = threading.Lock()
        self._families, self._metrics = {}, {}
        self._background = {f.name for f in background}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()   # (family, value, labels); None: close
        self._publisher = None
        if self._background:
            self._publisher = threading.Thread(target=self._publish_queued, daemon=True, name=f"{model} metrics")
            self._publisher.start()
        for family in families:
            try:
                kind = getattr(pb_utils.MetricFamily, family.kind.upper())
                self._families[family.name] = pb_utils.MetricFamily(
                    name=family.name, description=family.description, kind=kind)
            except (AttributeError, pb_utils.TritonModelException):
                continue
            if not family.labels:
                self._series(family, {})

    def publish(self, family: Family, value: float, extra: dict) -> None:
        """Observe (histogram), increment (counter) or set (gauge) ``family``'s series for ``extra`` labels (a
        ``background`` family's: queued for the publishing thread)."""
        if family.name in self._background:
            self._queue.put((family, value, extra))
            return
        self._publish_now(family, value, extra)

    def _publish_queued(self) -> None:
        for item in iter(self._queue.get, None):   # (until close's None: everything queued before it is out)
            self._publish_now(*item)

    def _publish_now(self, family: Family, value: float, extra: dict) -> None:
        with self._lock:
            metric = self._series(family, extra) if family.name in self._families else None
            if metric is None:
                return
            if family.kind == "histogram":
                metric.observe(float(value))
            elif family.kind == "counter":
                metric.increment(float(value))
            else:
                metric.set(float(value))

    def _series(self, family: Family, extra: dict):
        """``family``'s series for ``extra`` labels, made on first use (None: the stub refused it)."""
        key = (family.name, tuple(sorted(extra.items())))
        metric = self._metrics.get(key)
        if metric is None:
            buckets = {"buckets": list(family.buckets)} if family.kind == "histogram" else {}
            try:
                metric = self._families[family.name].Metric(labels={**self.labels, **extra}, **buckets)
            except Exception:  # noqa: BLE001  (a series the stub refuses must not fail a request)
                self._families.pop(family.name, None)
                return None
            self._metrics[key] = metric
        return metric

    def close(self) -> None:
        """What is queued goes out first; then metrics must go before their families (the stub checks)."""
        if self._publisher is not None:
            self._queue.put(None)
            self._publisher.join(5.0)
        with self._lock:
            self._metrics = {}
            self._families = {}
