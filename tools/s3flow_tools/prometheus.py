"""A real Prometheus (Debian's package: ``make prometheus``) on loopback, scraping a tritonserver's metrics, and the
queries the project ships read out of their files.

:class:`Prometheus` writes a scrape config for one target with the static ``namespace`` / ``pod`` labels a
cluster's service discovery would add, starts ``prometheus`` on a port of its own with its data in a temporary
folder, waits until it is ready and stops it by its PID. :meth:`Prometheus.query` evaluates an expression
through the HTTP API (``/api/v1/query``). The shipped queries: :func:`alert_rules` (the PrometheusRule's
``spec.groups``, as a plain rule file holds them), :func:`adapter_query` (prometheus-adapter's rule behind the HPA,
its template filled for one namespace) and :func:`dashboard_queries` (every Grafana panel's, its variables
substituted).

Example::

    with Prometheus("127.0.0.1:8002") as prom:
        prom.wait_for("s3flow_live_sequences")
        prom.query("sum(s3flow_live_sequences)")
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Optional

import yaml

from s3flow.server.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
DASHBOARD = ROOT / "docker" / "grafana" / "s3flow.json"
NAMESPACE, POD = "s3flow", "s3flow-triton-0"
#: series only a GPU host exports (``--allow-gpu-metrics``)
GPU_ONLY = ("nv_gpu_",)
#: "is it healthy?" (docs/operations.md): the four queries a platform engineer reads first
HEALTH = {
    "utilization (admission refuses above 0.9)": "max by (pod) (sum by (pod, model) (s3flow_utilization))",
    "demand (the HPA's metric: utilization + what was refused in the last 15 s)": "sum by (pod) (s3flow_demand)",
    "streams running dry per second": "sum(rate(s3flow_stream_underruns_total[5m]))",
    "STARTs refused per second, by reason": "sum by (reason) (rate(s3flow_admission_refusals_total[5m]))",
    "first audio p95 (s)": "histogram_quantile(0.95, sum by (le) (rate(s3flow_first_audio_seconds_bucket[5m])))",
}


def binary(name: str = "prometheus") -> str:
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} is not installed: make prometheus (Debian's prometheus package)")
    return found


def alert_rules() -> dict:
    """The PrometheusRule's groups as a plain rule file (``{"groups": [...]}``)."""
    [doc] = [d for d in yaml.safe_load_all((K8S / "prometheusrule.yaml").read_text()) if d]
    return {"groups": doc["spec"]["groups"]}


def adapter_query(namespace: str = NAMESPACE) -> str:
    """prometheus-adapter's metricsQuery for the HPA's metric, as the adapter fills it for the pods of
    ``namespace`` (``<<.Series>>``, ``<<.LabelMatchers>>``, ``<<.GroupBy>>``)."""
    [cm] = [d for d in yaml.safe_load_all((K8S / "prometheus-adapter.yaml").read_text()) if d]
    [rule] = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    series = rule["seriesQuery"].split("{")[0]
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", f'namespace="{namespace}",pod=~".+"').replace("<<.GroupBy>>", "pod"))


def dashboard_queries(rate_interval: str = "30s", namespace: str = NAMESPACE) -> list[tuple[str, str]]:
    """(panel title, expression) of every Grafana panel target, ``$namespace`` and ``$__rate_interval``
    substituted as Grafana does for one namespace."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p.get("title", ""), t["expr"].replace("$__rate_interval", rate_interval).replace("$namespace", namespace))
            for p in panels for t in p.get("targets", [])]


class Prometheus:
    """``prometheus`` scraping ``target`` (host:port of a metrics endpoint) every ``scrape_s``, with ``rules``
    (a rule file's dict) loaded; a context manager."""

    def __init__(self, target: str, scrape_s: float = 1.0, rules: Optional[dict] = None,
                 labels: Optional[dict] = None):
        self.target, self.scrape_s, self.rules = target, scrape_s, rules
        self.labels = labels or {"namespace": NAMESPACE, "pod": POD}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir: Optional[tempfile.TemporaryDirectory] = None
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Prometheus":
        self._dir = tempfile.TemporaryDirectory(prefix="s3flow-prometheus-")
        root = Path(self._dir.name)
        config = {"global": {"scrape_interval": f"{self.scrape_s:g}s", "evaluation_interval": f"{self.scrape_s:g}s"},
                  "scrape_configs": [{"job_name": "triton", "metrics_path": "/metrics",
                                      "static_configs": [{"targets": [self.target], "labels": self.labels}]}]}
        if self.rules is not None:
            (root / "rules.yml").write_text(yaml.safe_dump(self.rules, sort_keys=False))
            config["rule_files"] = [str(root / "rules.yml")]
        (root / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = root / "prometheus.log"
        with self.log.open("wb") as log:
            self._proc = subprocess.Popen([binary(), f"--config.file={root / 'prometheus.yml'}",
                                           f"--storage.tsdb.path={root / 'data'}",
                                           f"--web.listen-address=127.0.0.1:{self.port}"],
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self._proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError("prometheus was not ready within 60 s")

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._dir is not None:
            self._dir.cleanup()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def query(self, expr: str) -> list:
        """The instant vector ``expr`` evaluates to now: [(labels, value)]."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{expr}: {body}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def wait_for(self, expr: str, timeout_s: float = 30.0, check=lambda values: bool(values)) -> list:
        """Until ``check`` of ``expr``'s value holds (default: it has a series); its last value."""
        t0 = time.monotonic()
        while True:
            got = self.query(expr)
            if check(got) or time.monotonic() - t0 > timeout_s:
                return got
            time.sleep(self.scrape_s / 2)
