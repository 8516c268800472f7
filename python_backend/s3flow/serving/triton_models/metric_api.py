"""Publishing ``s3flow.serving.metrics`` families through the python backend's metric API (``pb_utils``).

One ``TritonMetrics`` per model instance: labels ``model`` and ``instance`` on every series, more per call
(``reason`` of a drop). A family with no more labels is made at once, at 0: a series that first appears already
counting hides its first increments from Prometheus's rate() (seen: first audio p95 NaN after a load). A family
the stub cannot make (no custom metrics, or no HISTOGRAM) is left out; the others still publish. Thread-safe (the solver's execute and its idle reaper both publish).
"""
from __future__ import annotations

import threading
from typing import Iterable

from s3flow.serving.metrics import Family
from s3flow.serving.triton_models.base import pb_utils


class TritonMetrics:
    def __init__(self, families: Iterable[Family], model: str, instance: str):
        self.labels = {"model": model, "instance": instance}
        self._lock = threading.Lock()
        self._families, self._metrics = {}, {}
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
        """Observe (histogram), increment (counter) or set (gauge) ``family``'s series for ``extra`` labels."""
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
        """Metrics must go before their families (the stub checks)."""
        with self._lock:
            self._metrics = {}
            self._families = {}
