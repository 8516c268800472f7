"""A real Prometheus (Debian's package, ``make prometheus``) against what the project ships: every alert rule of
docker/k8s/prometheusrule.yaml checked and unit-tested with promtool (each firing once and not once), and the
prometheus-adapter rule's query and every Grafana panel's query evaluated against a live scrape of a real
tritonserver under a bounded load (``s3flow_tools.prometheus``)."""
from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from s3flow.serving.demand import DEMAND_WINDOW_S
from s3flow_tools import prometheus
from s3flow_tools.prometheus import GPU_ONLY, HEALTH, Prometheus, adapter_query, alert_rules, dashboard_queries
from test_overload import at_once  # noqa: E402 (tests/ is on the path: conftest)

ROOT = Path(__file__).resolve().parents[1]
HPA_TARGET = 0.7   # docker/k8s/hpa.yaml's averageValue 700m (test_deploy checks the file)

#: per alert: the input series that fire it (at 60 m, every series one sample a minute), those that do not, and
#: the labels the alert carries beyond the rule's own (its ``by`` labels)
CASES = {
    "S3flowUtilizationAboveTarget": (
        ['s3flow_utilization{pod="p",model="cfm_solver",instance="cfm_solver_0_0"}', "0.95x60"],
        # the vocoder and the solver each at 0.5: 1.0 added, but the busiest stage is at 0.5
        ['s3flow_utilization{pod="p",model="cfm_solver",instance="cfm_solver_0_0"}', "0.5x60",
         's3flow_utilization{pod="p",model="vocoder",instance="vocoder_0_0"}', "0.5x60"], {"pod": "p"}),
    "S3flowStreamsRunningDry": (['s3flow_stream_underruns_total{pod="p"}', "0+1x60"],
                                ['s3flow_stream_underruns_total{pod="p"}', "3x60"], {}),
    "S3flowRefusingStarts": (['s3flow_admission_refusals_total{reason="capacity"}', "0+120x60"],
                             ['s3flow_admission_refusals_total{reason="invalid"}', "0+120x60",
                              's3flow_admission_refusals_total{reason="capacity"}', "0+30x60"], {}),
    "S3flowFirstChunkSlow": (
        ['s3flow_first_chunk_seconds_bucket{le="0.1"}', "0x60", 's3flow_first_chunk_seconds_bucket{le="1"}',
         "0+10x60", 's3flow_first_chunk_seconds_bucket{le="+Inf"}', "0+10x60"],
        ['s3flow_first_chunk_seconds_bucket{le="0.1"}', "0+10x60", 's3flow_first_chunk_seconds_bucket{le="1"}',
         "0+10x60", 's3flow_first_chunk_seconds_bucket{le="+Inf"}', "0+10x60"], {}),
    "S3flowChunkLatencyHigh": (
        ['s3flow_chunk_seconds_bucket{pod="p",le="1"}', "0x60", 's3flow_chunk_seconds_bucket{pod="p",le="5"}',
         "0+10x60", 's3flow_chunk_seconds_bucket{pod="p",le="+Inf"}', "0+10x60"],
        ['s3flow_chunk_seconds_bucket{pod="p",le="1"}', "0+10x60", 's3flow_chunk_seconds_bucket{pod="p",le="5"}',
         "0+10x60", 's3flow_chunk_seconds_bucket{pod="p",le="+Inf"}', "0+10x60"], {"pod": "p"}),
    "S3flowQueueing": (   # 1 s and 0.1 s of queue per request
        ['nv_inference_queue_duration_us{model="cfm_solver"}', "0+60000000x60",
         'nv_inference_request_success{model="cfm_solver"}', "0+60x60"],
        ['nv_inference_queue_duration_us{model="cfm_solver"}', "0+6000000x60",
         'nv_inference_request_success{model="cfm_solver"}', "0+60x60"], {}),
    "S3flowSequencesFailing": (['s3flow_sequences_dropped_total{reason="error"}', "0x55 1 1 1 1 1"],
                               ['s3flow_sequences_dropped_total{reason="idle"}', "0+1x60"], {}),
    "S3flowClientsVanishing": (   # 1 in 10 and 1 in 100 utterances evicted
        ['s3flow_sequences_dropped_total{reason="idle"}', "0+1x60", "s3flow_first_chunk_seconds_count", "0+10x60"],
        ['s3flow_sequences_dropped_total{reason="idle"}', "0+1x60", "s3flow_first_chunk_seconds_count", "0+100x60"],
        {}),
    "S3flowNearCapacity": (['s3flow_live_sequences{pod="p",instance="cfm_solver_0_0"}', "60x60"],
                           ['s3flow_live_sequences{pod="p",instance="cfm_solver_0_0"}', "40x60"], {"pod": "p"}),
    "S3flowStepsAboveExpected": (['s3flow_chunk_nfe_sum', "0+400x60", "s3flow_chunk_nfe_count", "0+10x60"],
                                 ['s3flow_chunk_nfe_sum', "0+100x60", "s3flow_chunk_nfe_count", "0+10x60"], {}),
}


def series(flat: list) -> list[dict]:
    return [{"series": flat[k], "values": flat[k + 1]} for k in range(0, len(flat), 2)]


def promtool_tests(rules_file: str) -> dict:
    """promtool's unit-test file: each rule's firing and non-firing case, evaluated at 60 minutes."""
    tests = []
    for group in alert_rules()["groups"]:
        for rule in group["rules"]:
            fire, quiet, by = CASES[rule["alert"]]
            labels = {**rule.get("labels", {}), **by}
            summary = rule["annotations"]["summary"].replace("{{ $labels.pod }}", by.get("pod", ""))
            expected = [{"exp_labels": labels, "exp_annotations": {**rule["annotations"], "summary": summary}}]
            for inputs, alerts in ((fire, expected), (quiet, [])):
                tests.append({"interval": "1m", "input_series": series(inputs), "alert_rule_test": [
                    {"eval_time": "60m", "alertname": rule["alert"], "exp_alerts": alerts}]})
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


def test_every_shipped_alert_rule_passes_promtool_and_fires_once_and_not_once(tmp_path):
    rules = alert_rules()
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert sorted(names) == sorted(CASES), "every rule has its cases, and only shipped rules have"
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    check = subprocess.run([prometheus.binary("promtool"), "check", "rules", str(tmp_path / "rules.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(names)} rules found" in check.stdout + check.stderr
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(promtool_tests("rules.yml"), sort_keys=False))
    run = subprocess.run([prometheus.binary("promtool"), "test", "rules", str(tmp_path / "tests.yml")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


def test_promtool_fails_a_case_that_is_wrong(tmp_path):
    """The unit tests can fail: a non-firing case expected to fire is reported."""
    rules = alert_rules()
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    doc = promtool_tests("rules.yml")
    doc["tests"][1]["alert_rule_test"][0]["exp_alerts"] = doc["tests"][0]["alert_rule_test"][0]["exp_alerts"]
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    run = subprocess.run([prometheus.binary("promtool"), "test", "rules", str(tmp_path / "tests.yml")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode != 0 and "S3flowUtilizationAboveTarget" in run.stdout + run.stderr


# ------------------------------------------------------------------------------------------ a live scrape
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from s3flow.engine.settings import SolverSettings
    from s3flow.repository.settings import Batching, RepositorySettings
    from s3flow.server.triton_server import TritonServer
    from s3flow_tools.bench.repos import trained_repository

    root = tmp_path_factory.mktemp("prometheus")
    # admission by capacity on (its refusals and retry_after are on the dashboard), a short idle window (drops)
    settings = RepositorySettings(solver=SolverSettings.of(max_live_sequences=16, idle_timeout_s=2.0),
                                  batching=Batching(max_queue_delay_us=2000, max_candidate_sequences=32),
                                  ort_threads=1)
    repo = trained_repository(root, settings)
    with TritonServer(repo, log_file=root / "server.log", background_stop=True) as server:
        yield server


def vanishing_client(url: str) -> None:
    """A START and no END: the solver evicts it after its idle window (a drop, by reason idle)."""
    import tritonclient.grpc as grpcclient
    from s3flow_client.demo import demo_utterance
    from s3flow_client.wire import infer_inputs
    from s3flow_contract.tensors import request_arrays

    u = demo_utterance(1.0, seed=99, noise_seed=1)
    arrays = request_arrays(u.speech_tokens[:10], start=True, prompt_tokens=u.prompt_tokens, prompt_mel=u.prompt_mel,
                            speaker_embedding=u.speaker_embedding)
    grpcclient.InferenceServerClient(url).infer("token2mel", infer_inputs(arrays), sequence_id=987654,
                                                sequence_start=True, sequence_end=False)


@pytest.mark.server
def test_the_adapter_rule_and_every_dashboard_query_return_data_from_a_live_scrape(served):
    with Prometheus(f"127.0.0.1:{served.metrics_port}", scrape_s=1.0) as prom:
        assert prom.wait_for("up", check=lambda v: v and v[0][1] == 1.0), "the server's metrics are not scraped"
        idle = prom.wait_for(adapter_query(), check=lambda v: bool(v))
        assert idle and max(v for _, v in idle) < HPA_TARGET, f"idle: {idle}"
        peak, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                peak.extend(v for _, v in prom.query(adapter_query()))
                time.sleep(0.5)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            errors = [r for model in ("token2wav", "token2mel") for r in at_once(served.grpc_url, model, 12)
                      if isinstance(r, str)]   # 12 at once through each, no retry: the refusals
        finally:
            stop.set()
            watcher.join()
        assert any("disposition=busy" in e for e in errors), "the overload was refused nowhere"
        assert max(peak) > HPA_TARGET, f"the HPA's metric under overload: at most {max(peak):.2f}"
        vanishing_client(served.grpc_url)
        refused = 'sum(s3flow_admission_refusals_total{reason="capacity"})'
        assert prom.wait_for(refused, check=lambda v: v and v[0][1] > 0)
        assert prom.wait_for('sum(s3flow_sequences_dropped_total{reason="idle"})',
                             check=lambda v: v and v[0][1] > 0, timeout_s=30)
        time.sleep(3)   # a few scrapes after the last change, inside every panel's rate window
        empty = []
        for title, expr in dashboard_queries():
            if any(name in expr for name in GPU_ONLY):
                continue
            values = prom.query(expr)
            if not values:
                empty.append(f"{title}: {expr}")
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
        for what, expr in HEALTH.items():   # docs/operations.md, "Is it healthy?", shows these values
            values = prom.query(expr)
            assert values, f"{what}: {expr} has no data"
            print(f"\n{what}: " + ", ".join(f"{dict(labels)} {v:.3g}" for labels, v in values))
        [(_, first_audio)] = prom.query(HEALTH["first audio p95 (s)"])
        assert 0 < first_audio < 60, f"first audio p95 {first_audio}: the histogram's first observations unseen"
        print(f"\nthe HPA's metric (demand: held + refused) under the overload, at most: {max(peak):.2f}")
        after = prom.wait_for(adapter_query(), check=lambda v: v and max(x for _, x in v) < HPA_TARGET,
                              timeout_s=DEMAND_WINDOW_S + 30)   # the refused leave the demand after its window
        assert max(v for _, v in after) < HPA_TARGET, f"the streams ended, the HPA's metric stays at {after}"
