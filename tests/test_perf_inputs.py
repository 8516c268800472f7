"""perf_analyzer input data (scripts/perf_inputs.py): the documented format, the server's rules, a real replay.

(a) The generated JSON is checked against a JSON Schema written from perf_analyzer's docs/input_data.md
(sequence mode: ``data`` a list of streams, a stream a list of steps, a tensor an array or
``{"content", "shape"}``), then against the loader's semantic rules and the server's own validator
(``check_input_data``); each rule is also shown to catch a broken document.
(b) The JSON is replayed with plain tritonclient gRPC streaming (START on a stream's first step, END on its
last, one correlation id per stream, several streams in flight) against a real tritonserver serving the
trained small model, through token2mel and token2wav: not one request may be refused and every stream must
get 2 frames per token. The same server answers the HTTP paths the deploy files probe (tests/test_deploy.py).
"""
from __future__ import annotations

import copy
import importlib.util
import json
import sys
import urllib.request
from pathlib import Path

import jsonschema
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("perf_inputs", ROOT / "scripts" / "perf_inputs.py")
perf_inputs = importlib.util.module_from_spec(_spec)
sys.modules["perf_inputs"] = perf_inputs  # dataclasses look their module up there
_spec.loader.exec_module(perf_inputs)

#: perf_analyzer's real-input-data format as its docs/input_data.md describes it (the loader,
#: src/data_loader.cc, reads exactly these shapes: anything else is "malformed" or "missing content").
_TENSOR = {
    "oneOf": [
        {"type": "array", "items": {"type": ["number", "string", "boolean"]}},
        {"type": "object", "required": ["content"], "additionalProperties": False,
         "properties": {"content": {"oneOf": [
             {"type": "array", "items": {"type": ["number", "string", "boolean"]}},
             {"type": "object", "required": ["b64"], "properties": {"b64": {"type": "string"}}}]},
             "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
        {"type": "object", "required": ["b64"], "properties": {"b64": {"type": "string"}}},
    ]
}
PERF_ANALYZER_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "array", "minItems": 1, "oneOf": [
            {"items": {"type": "object", "additionalProperties": _TENSOR}},                       # plain
            {"items": {"type": "array", "minItems": 1,                                          # sequences
                       "items": {"type": "object", "additionalProperties": _TENSOR}}},
        ]},
        "validation_data": {"type": "array"},
    },
}


def schema_for(inputs) -> dict:
    """The documented schema narrowed to the model's inputs (a step naming another tensor is refused)."""
    s = copy.deepcopy(PERF_ANALYZER_SCHEMA)
    step = s["properties"]["data"]["oneOf"][1]["items"]["items"]
    step["propertyNames"] = {"enum": sorted(inputs) + ["model"]}
    step["required"] = sorted(n for n, i in inputs.items() if not i.optional)
    return s


@pytest.fixture(scope="module")
def inputs():
    return perf_inputs.model_inputs()


@pytest.fixture(scope="module")
def heldout_doc():
    sources = perf_inputs.heldout_sources()
    return sources, json.loads(json.dumps(perf_inputs.input_data(sources, 4)))


def test_model_inputs_come_from_the_generated_config(inputs):
    from s3flow.protocol import INPUT_DTYPES, START_ONLY
    from s3flow_contract.tensors import VOICE_ID

    assert set(inputs) == set(INPUT_DTYPES) | {VOICE_ID}
    assert not inputs["speech_tokens"].optional and all(inputs[n].optional for n in (*START_ONLY, VOICE_ID))
    assert inputs["prompt_mel"].dims == (-1, 80) and inputs["speech_tokens"].datatype == "INT64"


def test_heldout_json_follows_the_documented_schema_and_the_servers_rules(heldout_doc, inputs):
    sources, doc = heldout_doc
    jsonschema.validate(doc, schema_for(inputs))
    assert perf_inputs.check_input_data(doc, inputs) == []
    assert len(doc["data"]) == len(sources) == 64   # every shipped held-out utterance
    for src, stream in zip(sources, doc["data"]):
        assert len(stream) == 4
        assert set(stream[0]) == {"speech_tokens", "prompt_tokens", "prompt_mel", "speaker_embedding", "seed"}
        assert all(set(step) == {"speech_tokens"} for step in stream[1:])
        arrays = [perf_inputs.step_arrays(step, inputs) for step in stream]
        # what a request carries is the utterance itself, bit for bit (float32 survives the JSON)
        np.testing.assert_array_equal(np.concatenate([a["speech_tokens"][0] for a in arrays]), src.speech_tokens)
        np.testing.assert_array_equal(arrays[0]["prompt_mel"][0], src.prompt_mel)
        np.testing.assert_array_equal(arrays[0]["speaker_embedding"][0], src.speaker_embedding)
        assert arrays[0]["prompt_mel"].shape == (1, 2 * len(src.prompt_tokens), 80)


def test_heldout_sources_match_the_training_packages_loader():
    from s3flow_training.package import load_heldout

    ours, theirs = perf_inputs.heldout_sources(limit=3), load_heldout(perf_inputs.HELDOUT)[:3]
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a.speech_tokens, b.speech_tokens)
        np.testing.assert_array_equal(a.prompt_mel, b.prompt_mel.T)   # frames-major on the wire
        np.testing.assert_array_equal(a.speaker_embedding, b.xvector)


def test_seeded_json_with_options_is_valid(inputs):
    doc = json.loads(json.dumps(perf_inputs.input_data(perf_inputs.seeded_sources(3, 10.0), 6, n_timesteps=2,
                                                       guidance_rate=0.5)))
    jsonschema.validate(doc, schema_for(inputs))
    assert perf_inputs.check_input_data(doc, inputs) == []
    assert doc["data"][0][0]["n_timesteps"] == {"content": [2], "shape": [1]}


@pytest.mark.parametrize("n, steps", [(4, 4), (47, 4), (146, 4), (250, 6), (1000, 3), (30, 7)])
def test_fixed_schedule_has_exactly_the_steps(n, steps):
    sizes = perf_inputs.fixed_schedule(n, steps)
    assert len(sizes) == steps and sum(sizes) == n and min(sizes) >= 1


def test_fixed_schedule_refuses_too_short_utterances():
    with pytest.raises(ValueError, match="3 tokens"):
        perf_inputs.fixed_schedule(3, 4)


BREAKS = {
    "token id out of vocabulary": (lambda d: d["data"][0][1]["speech_tokens"]["content"].__setitem__(0, 6561),
                                   "would refuse"),
    "prompt on a middle step": (lambda d: d["data"][0][1].update(seed={"content": [1], "shape": [1]}),
                                "would refuse"),
    "no prompt on START": (lambda d: d["data"][1][0].pop("prompt_mel"), "would refuse"),
    "count does not fit shape": (lambda d: d["data"][0][2]["speech_tokens"]["shape"].__setitem__(0, 999),
                                 "values for shape"),
    "wrong rank": (lambda d: d["data"][0][0]["prompt_mel"].update(shape=[-1]), "fully defined"),
    "fixed dim mismatch": (lambda d: d["data"][0][0]["speaker_embedding"].update(
        content=[0.0] * 191, shape=[191]), "does not fit the model's dims"),
    "float in an INT64 tensor": (lambda d: d["data"][0][1]["speech_tokens"]["content"].__setitem__(0, 1.5),
                                 "non-integers"),
    "unknown tensor": (lambda d: d["data"][0][1].update(tokens={"content": [1], "shape": [1]}), "not model inputs"),
    "missing speech_tokens": (lambda d: d["data"][0][1].pop("speech_tokens"), "missing required"),
    "streams of different lengths": (lambda d: d["data"][0].pop(), "different step counts"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_rule_check_catches_a_broken_document(heldout_doc, inputs, case):
    doc = copy.deepcopy({"data": heldout_doc[1]["data"][:3]})
    breaker, message = BREAKS[case]
    breaker(doc)
    problems = perf_inputs.check_input_data(doc, inputs)
    assert any(message in p for p in problems), problems


def test_schema_catches_what_perf_analyzer_calls_malformed(heldout_doc, inputs):
    schema = schema_for(inputs)
    good = {"data": heldout_doc[1]["data"][:2]}
    for breaker in (lambda d: d["data"][0][0].update(speech_tokens=7),                    # not array/object
                    lambda d: d["data"][0][0]["speech_tokens"].pop("content"),            # missing content
                    lambda d: d["data"][0][0]["speech_tokens"].update(shape=[1.5]),       # shape not integers
                    lambda d: d["data"][1].append([]),                                    # a step that is a list
                    lambda d: d["data"][0][1].update(tokens=[1])):                        # not a model input
        doc = copy.deepcopy(good)
        breaker(doc)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)


def test_command_line_writes_and_checks(tmp_path):
    out = tmp_path / "in.json"
    assert perf_inputs.main(["--limit", "2", "--sequence-length", "3", "--output", str(out)]) == 0
    assert len(json.loads(out.read_text())["data"]) == 2
    assert perf_inputs.main(["--seeded", "1", "--seconds", "0.1", "--sequence-length", "4",
                             "--output", str(tmp_path / "x.json")]) == 1   # 2 tokens cannot fill 4 steps


# ------------------------------------------------------------------------------------------ served
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from s3flow.engine.settings import SolverSettings
    from s3flow.repository.settings import Batching, RepositorySettings
    from s3flow.server.triton_server import TritonServer
    from s3flow_tools.bench.repos import trained_repository

    root = tmp_path_factory.mktemp("perf_inputs")
    # a replay as fast as it is answered, not real-time streams: admission by capacity off, as for perf_analyzer
    settings = RepositorySettings(solver=SolverSettings.of(max_live_sequences=8, utilization_target=0.0),
                                  batching=Batching(max_queue_delay_us=20_000, max_candidate_sequences=16),
                                  ort_threads=1)
    with TritonServer(trained_repository(root, settings), log_file=root / "server.log",
                      background_stop=True) as server:
        yield server


@pytest.mark.server
@pytest.mark.parametrize("model, concurrency", [("token2mel", 3), ("token2wav", 2)])
def test_replayed_json_is_never_refused_and_every_stream_gets_its_frames(served, tmp_path, model, concurrency):
    path = tmp_path / "perf_inputs.json"
    assert perf_inputs.main(["--limit", "5", "--sequence-length", "4", "--n-timesteps", "2",
                             "--output", str(path)]) == 0
    doc = json.loads(path.read_text())
    config = served.client().get_model_config(model, as_json=False).config
    inputs = perf_inputs.model_inputs(config)  # the served config, not ours
    assert perf_inputs.check_input_data(doc, inputs) == []
    res = perf_inputs.replay(doc, served.grpc_url, model, concurrency=concurrency, inputs=inputs,
                             first_sequence_id=1000 if model == "token2mel" else 2000)
    assert res.errors == [] and res.order_problems == []
    assert res.requests == 5 * 4
    assert res.frames == res.expected and all(n > 0 for n in res.expected.values())


@pytest.mark.server
def test_replay_reports_a_refused_request(served):
    doc = perf_inputs.input_data(perf_inputs.heldout_sources(limit=2), 3, n_timesteps=2)
    doc["data"][1][1]["speech_tokens"]["content"][0] = 6561   # what perf_analyzer's random data would send
    res = perf_inputs.replay(doc, served.grpc_url, "token2mel", concurrency=2, first_sequence_id=3000)
    assert len(res.errors) == 1 and "6561" in res.errors[0]
    assert not res.ok and res.frames[3000] == res.expected[3000] and res.frames[3001] < res.expected[3001]


@pytest.mark.server
def test_the_deploy_files_http_paths_answer_on_a_real_server(served):
    from test_deploy import HEALTH_PATHS, METRICS_PATH

    for path in sorted(HEALTH_PATHS):
        with urllib.request.urlopen(f"http://127.0.0.1:{served.http_port}{path}", timeout=5) as r:
            assert r.status == 200, path
    from s3flow.server.metrics_reader import parse_metrics

    with urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}{METRICS_PATH}", timeout=5) as r:
        assert r.status == 200
        samples = parse_metrics(r.read().decode(), prefix="")  # prometheus_client's parser
    # the parser names a counter's samples <name>_total, as OpenMetrics does (Triton's text has no suffix)
    assert any(name == "nv_inference_request_success_total" for name, _ in samples)
    assert any(name == "s3flow_live_sequences" for name, _ in samples)


def documented_commands(program: str) -> list[list[str]]:
    """The ``program`` command lines of docs/operations.md's shell blocks (continuations joined, comments
    dropped), each from the program's name on."""
    import re
    import shlex

    text = (ROOT / "docs" / "operations.md").read_text()
    lines = "".join(re.findall(r"```bash\n(.*?)```", text, re.S)).replace("\\\n", " ").splitlines()
    out = []
    for line in lines:
        words = shlex.split(line, comments=True)
        starts = [k for k, w in enumerate(words) if w.endswith(program)]
        if starts:
            out.append(words[starts[0]:])
    return out


def test_documented_perf_analyzer_commands_fit_the_written_file():
    writers = {}
    for argv in documented_commands("perf_inputs.py"):
        if "--replay" in argv:
            continue
        args = dict(zip(argv, argv[1:]))   # flag -> the word after it
        writers[args.get("--output", "out/perf_inputs.json")] = int(args.get("--sequence-length", 4))
    runs = documented_commands("perf_analyzer")
    assert {r[r.index("-m") + 1] for r in runs} == {"token2mel", "token2wav"}
    ranges = []
    for run in runs:
        args = dict(zip(run, run[1:]))
        assert args["-i"] == "grpc" and "--streaming" in run
        assert args["--input-data"] in writers, f"{args['--input-data']} is written by no documented command"
        assert int(args["--sequence-length"]) == writers[args["--input-data"]], "steps per stream differ"
        assert float(args["--sequence-length-variation"]) == 0
        lo, hi = map(int, args["--sequence-id-range"].split(":"))
        span = args["--concurrency-range"].split(":")   # start[:end[:step]]
        top = int(span[1] if len(span) > 1 else span[0])
        assert hi - lo >= top
        ranges.append((lo, hi))
    ranges.sort()
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), "the runs' sequence ids overlap"
