"""The overhead profile's reading of Triton's trace file (``s3flow_tools.measure.overhead``): records of one
request split across several entries, ensemble steps and BLS calls as children, a batched execute's calls
charged to each of its chunks. The served run itself writes results/overhead.md."""
import json

import pytest

from s3flow_tools.measure.overhead import chunks_of, read_traces

MS = 1_000_000


def _records(id_, model, parent, **stamps):
    """Two entries, as Triton writes them: the request's names, then its timestamps (ms here)."""
    head = {"id": id_, "model_name": model, "model_version": 1}
    if parent:
        head["parent_id"] = parent
    return [head, {"id": id_, "timestamps": [{"name": k, "ns": v * MS} for k, v in stamps.items()]}]


def _model(id_, model, parent, start, queue, compute, end):
    """A request from ``start`` to ``end`` ms: queued until ``queue``, its own work from ``compute[0]`` to
    ``compute[1]``."""
    return _records(id_, model, parent, REQUEST_START=start, QUEUE_START=start, COMPUTE_START=queue,
                    COMPUTE_INPUT_END=compute[0], COMPUTE_OUTPUT_START=compute[1], COMPUTE_END=end, REQUEST_END=end)


def test_a_chunk_is_split_into_hops_admission_queue_calls_and_solver_python(tmp_path):
    records = (_records(1, "token2mel", 0, REQUEST_START=0, REQUEST_END=100)
               + _model(2, "admission", 1, 1, 2, (2, 4), 5)            # 4 ms
               + _model(3, "cfm_solver", 1, 7, 10, (10, 10), 95)      # queue 3 ms, execute 85 ms
               + _model(4, "flow_encoder", 3, 12, 13, (14, 20), 21)   # 9 ms span, 6 compute
               + _model(5, "estimator", 3, 30, 31, (32, 52), 53)      # 23 ms span, 20 compute
               + _model(6, "estimator", 3, 60, 61, (62, 82), 83))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(records))
    [chunk] = chunks_of(read_traces(path))
    p = {k: round(v * 1000, 6) for k, v in chunk.parts.items()}
    assert p["admission"] == 4 and p["solver queue"] == 3
    assert p["ensemble hops"] == 100 - 4 - 88
    assert p["encoder compute"] == 6 and p["encoder call fixed"] == 3
    assert p["estimator compute"] == 40 and p["estimator call fixed"] == 6
    assert p["solver Python before the calls"] == 12 - 10 and p["solver Python after the calls"] == 95 - 83
    assert p["solver Python between calls"] == 85 - 9 - 46 - 2 - 12
    assert (chunk.encoder_calls, chunk.estimator_calls, chunk.batch) == (1, 2, 1)
    assert chunk.parts["client and gRPC"] != chunk.parts["client and gRPC"], "the client's part is left to measure"


def test_a_batched_execute_charges_its_calls_to_each_chunk_and_skips_a_refused_start(tmp_path):
    records = (_records(1, "token2mel", 0, REQUEST_START=0, REQUEST_END=50)
               + _model(2, "admission", 1, 0, 0, (0, 1), 1)
               + _model(3, "cfm_solver", 1, 2, 5, (5, 5), 45)
               + _records(10, "token2mel", 0, REQUEST_START=1, REQUEST_END=50)
               + _model(11, "admission", 10, 1, 1, (1, 2), 2)
               + _model(12, "cfm_solver", 10, 3, 5, (5, 5), 45)       # the same execute (COMPUTE_START 5)
               + _model(4, "estimator", 3, 10, 10, (11, 31), 32)      # traced under the execute's first request
               + _records(20, "token2mel", 0, REQUEST_START=2, REQUEST_END=3)
               + _model(21, "admission", 20, 2, 2, (2, 3), 3))        # refused: never reached the solver
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(records))
    chunks = chunks_of(read_traces(path))
    assert len(chunks) == 2
    for c in chunks:
        assert c.batch == 2 and c.estimator_calls == 1
        assert c.parts["estimator compute"] == pytest.approx(0.020)
        python = sum(v for k, v in c.parts.items() if k.startswith("solver Python"))
        assert python == pytest.approx(0.040 - 0.022)
