"""Triton's perf_analyzer (``s3flow_tools.perf_analyzer``, installed by ``make perf-analyzer``) run for real: over
gRPC streaming against ``token2mel`` and ``token2wav`` on a real tritonserver, with scripts/perf_inputs.py's
file, and the command docs/operations.md shows is the one run here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from s3flow.server.metrics_reader import metric_sum, read_metrics
from s3flow_tools import perf_analyzer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import perf_inputs  # noqa: E402

from test_perf_inputs import documented_commands  # noqa: E402

STEPS = 4


def test_perf_analyzer_is_installed_and_starts():
    """``make test`` installs it first (``make perf-analyzer``): a missing binary or library fails here."""
    said = perf_analyzer.version()
    assert said and said.startswith("Perf Analyzer Version 2.41.1"), \
        f"perf_analyzer does not start from {perf_analyzer.binary()}: run make perf-analyzer"


def test_the_documented_commands_are_the_ones_run():
    """docs/operations.md's perf_analyzer lines carry the flags ``command`` gives (those that settle on a stream's
    4x-differing chunks; no --percentile), whatever their model, ids, concurrency and output file."""
    ours = perf_analyzer.command("127.0.0.1:8001", "token2mel", Path("out/perf_inputs.json"), 4, STEPS,
                                 Path("out/perf_token2mel.csv"))
    own = {"-m", "-u", "--input-data", "--sequence-id-range", "--concurrency-range", "-f",
           "--measurement-request-count"}

    def flags(argv):
        pairs, k = {}, 1
        while k < len(argv):
            takes = k + 1 < len(argv) and not argv[k + 1].startswith("-")
            pairs[argv[k]] = argv[k + 1] if takes else None
            k += 2 if takes else 1
        return {f: v for f, v in pairs.items() if f not in own}

    runs = documented_commands("perf_analyzer")
    assert runs and all(flags(r) == flags(ours) for r in runs), [flags(r) for r in runs]
    assert "--percentile" not in ours


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from s3flow.engine.settings import SolverSettings
    from s3flow.repository.settings import Batching, RepositorySettings
    from s3flow.server.triton_server import TritonServer
    from s3flow_tools.bench.repos import trained_repository

    root = tmp_path_factory.mktemp("perf_analyzer")
    # as fast as answered, not real time: admission by capacity off (docs/operations.md)
    settings = RepositorySettings(solver=SolverSettings.of(max_live_sequences=8, utilization_target=0.0),
                                  batching=Batching(max_queue_delay_us=20_000, max_candidate_sequences=16),
                                  ort_threads=1)
    repo = trained_repository(root, settings)
    data = root / "perf_inputs.json"
    assert perf_inputs.main(["--limit", "8", "--sequence-length", str(STEPS), "--n-timesteps", "2",
                             "--output", str(data)]) == 0
    with TritonServer(repo, log_file=root / "server.log", background_stop=True) as server:
        server.perf_data = data
        yield server


def counts(server, model: str) -> tuple[float, float]:
    m = read_metrics(f"127.0.0.1:{server.metrics_port}", prefix="nv_")   # counters read as <name>_total
    return (metric_sum(m, "nv_inference_request_success_total", model=model),
            metric_sum(m, "nv_inference_request_failure_total", model=model))


@pytest.mark.server
@pytest.mark.parametrize("model, first_id", [("token2mel", 1_000_000), ("token2wav", 5_000_000)])
def test_perf_analyzer_drives_each_ensemble_at_concurrency_1_and_4_and_every_request_is_answered(
        served, model, first_id):
    ok_before, failed_before = counts(served, model)
    res = perf_analyzer.run(served.grpc_url, model, served.perf_data, [1, 4], STEPS, first_sequence_id=first_id,
                            window_requests=2 * STEPS * 4, timeout_s=300)
    assert res.ok, res.output[-3000:]
    assert [lv.concurrency for lv in res.levels] == [1, 4] and all(lv.per_s > 0 for lv in res.levels)
    ok, failed = counts(served, model)
    assert failed == failed_before, f"{failed - failed_before:.0f} requests failed:\n{res.output[-2000:]}"
    assert ok - ok_before >= 3 * 2 * STEPS * 4, "fewer requests answered than the measurement windows hold"
    live = metric_sum(read_metrics(f"127.0.0.1:{served.metrics_port}"), "s3flow_live_sequences")
    assert live == 0, "perf_analyzer's sequences left live: each ends on its last step"
