"""Reading a server's Prometheus metrics back (tests, the drain supervisor, the load test): samples by name and
labels, sums, histograms and their quantiles. The families themselves are ``s3flow.serving.metrics``'s.

Example::

    m = read_metrics("127.0.0.1:8002")
    metric_sum(m, "s3flow_live_sequences"), histogram(m, "s3flow_chunk_seconds").quantile(0.95)
"""
from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from typing import Optional


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


def priced(metrics_url: str, ensemble: str = "token2mel", timeout_s: float = 3.0) -> bool:
    """Whether the solver has priced its work: the ensemble's capacity gauge (``s3flow_capacity_audio_seconds_per_
    second``) shows, after its calibration at load or from a saved price."""
    metrics = read_metrics(metrics_url, timeout_s=timeout_s)
    return metric_sum(metrics, "s3flow_capacity_audio_seconds_per_second", ensemble=ensemble) > 0


def wait_priced(metrics_url: str, ensemble: str = "token2mel", timeout_s: float = 60.0) -> bool:
    """Until the solver's calibration at load is over (``priced``): a measurement must not share the cores with
    it. True once it is."""
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if priced(metrics_url, ensemble):
            return True
        time.sleep(0.5)
    return False
