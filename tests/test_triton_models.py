"""The python models' shared base (s3flow.serving.triton_models.base) without a server: configs built from the
contract (as the generator writes them) load; a config that differs from the contract, a boolean spelled
other than true/false, or missing sequence controls fail the load with a TritonModelException naming the model
and the value; one bad request gets its own error response and the others still get theirs.

The stub's ``triton_python_backend_utils`` is replaced by a small stand-in (``FakePbUtils``); the served path
through a real tritonserver is tests/test_serving.py, tests/test_faults.py and tests/test_vocoder.py.
"""
from __future__ import annotations

import json
import time
import types

import numpy as np
import pytest
import torch
from google.protobuf import json_format

from s3flow_contract import tensors as contract
from s3flow.model.solver import EstimatorInputs
from s3flow.protocol import RequestError
from s3flow.repository import model_config as mc
from s3flow.serving import responses
from s3flow.serving.incoming import Outcome
from s3flow.serving.triton_models import (base, bls, cfm_solver, metric_api, onnx_model, torch_model, voice_encoder_model,
                                         vocoder_model)


class TritonModelException(Exception):
    pass


class TritonError:
    INVALID_ARG, INTERNAL, UNAVAILABLE, CANCELLED = "INVALID_ARG", "INTERNAL", "UNAVAILABLE", "CANCELLED"

    def __init__(self, message, code=INTERNAL):
        self._message, self.code = message, code

    def message(self):
        return self._message


class Response:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array

    def to_dlpack(self):
        return torch.utils.dlpack.to_dlpack(torch.from_numpy(self.array))

    @classmethod
    def from_dlpack(cls, name, capsule):
        return cls(name, torch.utils.dlpack.from_dlpack(capsule).numpy())


class Request(dict):
    """Input arrays by name; ``params`` the request parameters (Triton's JSON: forwarded headers); ``outputs`` the
    outputs it asks for."""
    params = "{}"
    outputs = ("mel", "frame_offset")

    def parameters(self):
        return self.params

    def requested_output_names(self):
        return list(self.outputs)

    def get_response_sender(self):
        """The stand-in of the request's response sender: ``self.sent`` records (response, flags)."""
        self.sent = getattr(self, "sent", [])
        return types.SimpleNamespace(send=lambda response, flags=0: self.sent.append((response, flags)))


def FakePbUtils():  # noqa: N802 (a module stand-in)
    return types.SimpleNamespace(
        TritonModelException=TritonModelException, TritonError=TritonError, InferenceResponse=Response,
        Tensor=Tensor, TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, Logger=types.SimpleNamespace(**{f"log_{kind}": lambda message: None for kind in ("info", "warn", "error", "verbose")}),
        get_input_tensor_by_name=lambda request, name: Tensor(name, request[name]) if name in request else None)


@pytest.fixture(autouse=True)
def pb_utils(monkeypatch):
    fake = FakePbUtils()
    for module in (responses, base, cfm_solver, bls, metric_api, torch_model):
        monkeypatch.setattr(module, "pb_utils", fake)
    return fake


def args_of(config: mc.ModelConfig, folder="/nonexistent") -> dict:
    """``initialize``'s args: the config in Triton's JSON form (int64 dims as strings, enum names)."""
    as_json = json_format.MessageToDict(config, preserving_proto_field_name=True)
    return {"model_config": json.dumps(as_json), "model_name": config.name, "model_repository": folder,
            "model_version": "1", "model_instance_kind": "CPU"}


def solver_config(**params) -> mc.ModelConfig:
    config = mc.ModelConfig(name="cfm_solver", backend="python", max_batch_size=4)
    mc.add_tensors(config, contract.SOLVER_INPUTS, contract.SOLVER_OUTPUTS, n_feats=80)
    mc.add_sequence_controls(config, idle_us=10_000_000)
    return mc.set_parameters(config, {"n_feats": 80, "meanflow": False, "warmup": False, **params})


def vocoder_config(n_feats: int = 80, **params) -> mc.ModelConfig:
    config = mc.ModelConfig(name="vocoder", backend="python", max_batch_size=4)
    mc.add_tensors(config, contract.VOCODER_INPUTS, contract.VOCODER_OUTPUTS, n_feats=n_feats)
    mc.add_sequence_controls(config, idle_us=10_000_000)
    return mc.set_parameters(config, {"n_feats": 80, **params})


# ------------------------------------------------------------------------------------------ load-time checks
def load_error(model, config) -> str:
    with pytest.raises(TritonModelException) as info:
        model.initialize(args_of(config))
    return str(info.value)


def test_the_solver_refuses_a_boolean_not_spelled_true_or_false():
    message = load_error(cfm_solver.TritonPythonModel(), solver_config(warmup="yes"))
    assert message.startswith("cfm_solver: ") and "warmup must be true or false, got 'yes'" in message, message


def test_the_solver_refuses_a_config_that_differs_from_the_contract():
    config = solver_config()
    next(t for t in config.output if t.name == "frame_offset").data_type = mc.mc.TYPE_INT32
    message = load_error(cfm_solver.TritonPythonModel(), config)
    assert message.startswith("cfm_solver: ") and "frame_offset is TYPE_INT32" in message \
        and "TYPE_INT64" in message, message
    config = solver_config()
    del config.input[-1]  # voice_id
    assert "voice_id" in load_error(cfm_solver.TritonPythonModel(), config)


def test_sequence_models_need_every_control_and_batching():
    config = solver_config()
    del config.sequence_batching.control_input[-1]  # CORRID
    message = load_error(cfm_solver.TritonPythonModel(), config)
    assert "control inputs ('START', 'END', 'READY', 'CORRID')" in message and "['END', 'READY', 'START']" in message
    config = vocoder_config()
    config.max_batch_size = 0
    assert load_error(vocoder_model.TritonPythonModel(), config) == "vocoder: max_batch_size must be >= 1, got 0"
    config = vocoder_config()
    config.ClearField("sequence_batching")
    assert load_error(vocoder_model.TritonPythonModel(), config) == "vocoder: needs sequence_batching in its config"


def test_the_vocoder_checks_its_mel_bins_and_then_its_files():
    message = load_error(vocoder_model.TritonPythonModel(), vocoder_config(n_feats=79))
    assert "vocoder: input mel is TYPE_FP32 [79, -1] in the config, the contract says TYPE_FP32 [80, -1]" in message
    message = load_error(vocoder_model.TritonPythonModel(), vocoder_config(vocoder_backend="onnx"))
    assert message.startswith("vocoder: ") and "f0.onnx" in message, message  # the contract held: on to the files


def test_the_voice_encoder_checks_its_contract_before_its_weights():
    config = mc.ModelConfig(name="voice_encoder", backend="python", max_batch_size=0)
    mc.add_tensors(config, contract.VOICE_ENCODER_INPUTS[:-1], contract.VOICE_ENCODER_OUTPUTS, n_feats=80)
    message = load_error(voice_encoder_model.TritonPythonModel(), config)
    assert message.startswith("voice_encoder: config inputs") and "list_voices" in message, message


def test_config_feats_reads_the_mel_bins_the_config_declares():
    config = json.loads(args_of(vocoder_config(n_feats=100))["model_config"])
    assert base.config_feats(config, contract.VOCODER_INPUTS) == 100
    assert base.config_feats(config, contract.ENCODER_OUTPUTS) is None


# ------------------------------------------------------------------------------------------ requests
class Doubler(base.TritonModel):
    """The smallest model: ``mel`` in, twice it out; a negative value is a bad request, a NaN a failure."""

    def setup(self, args):
        self.check_contract(contract.VOCODER_INPUTS, contract.VOCODER_OUTPUTS)
        self.gain = self.params.float("gain", 2.0)

    def respond(self, request):
        mel = base.input_arrays(request, contract.VOCODER_INPUTS)["mel"]
        if (mel < 0).any():
            raise RequestError(f"mel must be >= 0, got {mel.min()}")
        if np.isnan(mel).any():
            raise RuntimeError("the network gave up")
        return base.ok_response({"audio": mel * self.gain})


def test_one_bad_request_gets_its_error_and_the_others_their_answers():
    model = Doubler()
    model.initialize(args_of(vocoder_config(gain=3)))
    good, bad, broken = (Request(mel=np.full((1, 80, 2), v, np.float32)) for v in (1.0, -1.0, np.nan))
    out = model.execute([good, bad, broken, good])
    assert [r.error is None for r in out] == [True, False, False, True]
    np.testing.assert_array_equal(out[0].outputs["audio"], np.full((1, 80, 2), 3.0, np.float32))
    assert (out[1].error.code, out[1].error.message()) == (
        "INVALID_ARG", "vocoder: mel must be >= 0, got -1.0 [s3flow disposition=fail]")
    assert (out[2].error.code, out[2].error.message()) == (
        "INTERNAL", "vocoder: RuntimeError: the network gave up [s3flow disposition=fail]")


def test_controls_read_as_triton_sends_them():
    request = Request(START=np.array([[1]], np.int32), END=np.array([[0]], np.int32),
                      READY=np.array([[1]], np.int32), CORRID=np.array([[7]], np.uint64))
    assert base.read_controls(request) == base.Controls(start=True, end=False, ready=True, corr_id=7)
    assert base.read_controls(Request()) == base.Controls(start=False, end=False, ready=False, corr_id=0)


def test_the_solver_reads_every_request_tensor_of_the_contract():
    model = cfm_solver.TritonPythonModel()
    arrays = contract.request_arrays([1, 2, 3], start=True, prompt_tokens=[4], prompt_mel=np.zeros((2, 80)),
                                     speaker_embedding=np.zeros(192), n_timesteps=3, guidance_rate=0.5, seed=1,
                                     voice_id="v-0", token_offset=0, resume=b"S3FS1", chunk_steps=2)
    request = Request(arrays, START=np.array([[1]], np.int32), READY=np.array([[1]], np.int32),
                      CORRID=np.array([[9]], np.uint64))
    request.is_cancelled = lambda: False
    request.params = '{"s3flow-tenant": "acme"}'
    incoming = model._incoming(request, 1.5)
    assert (incoming.corr_id, incoming.start, incoming.end, incoming.tenant) == (9, True, False, "acme")
    assert sorted(incoming.inputs) == sorted(contract.names(contract.REQUEST))
    assert incoming.arrived == 1.5
    assert not incoming.to_vocoder, "token2mel asks for no seed: its answers end at the client"
    model._sender(request, incoming)(Outcome())
    [(response, flags)] = request.sent
    assert flags == 1 and response.error is None, "deadline: its one answer goes through its sender, COMPLETE_FINAL"
    responses = [None, None]
    model._collector(responses, 1, incoming)(Outcome())
    assert responses[0] is None and responses[1].error is None, "fifo: its answer fills its place in execute's list"
    request.outputs = ("mel", "frame_offset", "seed")
    assert model._incoming(request, 0.0).to_vocoder, "token2wav's solver step passes the seed on to the vocoder"
    request.params = '{"s3flow-tenant": "not a tenant"}'   # called directly, past admission: owns no voice
    assert model._incoming(request, 0.0).tenant == "!invalid"


class _BlsRequest:
    """pb_utils.InferenceRequest's stand-in: records itself on exec; answers each requested output with
    ``answer(model_name, {input name: array}, output name)``."""

    def __init__(self, sent, answer, model_name, requested_output_names, inputs, **kwargs):
        self.sent, self.answer = sent, answer
        self.model_name, self.requested, self.inputs = model_name, requested_output_names, inputs

    def exec(self):
        self.sent.append(self)
        arrays = {t.name: t.array for t in self.inputs}
        return types.SimpleNamespace(has_error=lambda: False,
                                     outputs={n: self.answer(self.model_name, arrays, n) for n in self.requested})


@pytest.mark.parametrize("meanflow", [False, True])
def test_the_bls_adapters_send_contract_names_in_order_and_refuse_others(pb_utils, meanflow):
    """BlsEstimator sends an EstimatorInputs bundle as the estimator's contract inputs, in graph order, and returns
    the velocity; BlsEncoder sends its three tensors by name; tensors named otherwise or out of order are the
    caller's bug (TypeError, no request sent)."""
    sent = []
    answer = lambda model, arrays, name: (arrays["x"] * 2 if name == "velocity"
                                          else np.full((1, 2), len(name), np.float32))
    pb_utils.InferenceRequest = lambda **kw: _BlsRequest(sent, answer, **kw)
    pb_utils.get_output_tensor_by_name = lambda response, name: (Tensor(name, response.outputs[name])
                                                                 if name in response.outputs else None)
    wanted = contract.names(contract.estimator_inputs(meanflow))
    est = bls.BlsEstimator("estimator", wanted, contract.names(contract.ESTIMATOR_OUTPUTS))
    g = torch.Generator().manual_seed(0)
    b, t = 2, 5
    rows = lambda *shape: torch.randn(*shape, generator=g)
    inputs = EstimatorInputs(x=rows(b, 80, t), mask=torch.ones(b, 1, t), mu=rows(b, 80, t), t=torch.rand(b, generator=g),
                             spks=rows(b, 80), cond=rows(b, 80, t),
                             r=torch.rand(b, generator=g) if meanflow else None)
    v = est(inputs)
    [request] = sent
    assert request.model_name == "estimator" and request.requested == ["velocity"]
    assert tuple(x.name for x in request.inputs) == wanted
    for x in request.inputs:
        np.testing.assert_array_equal(x.array, getattr(inputs, x.name).numpy())
    torch.testing.assert_close(v, inputs.x * 2)
    other_kind = EstimatorInputs(**{**inputs.named(), "r": None if meanflow else inputs.t})
    with pytest.raises(TypeError, match=r"model 'estimator' takes \["):
        est(other_kind)
    with pytest.raises(TypeError, match=r"model 'estimator' takes \["):
        est.call(dict(reversed(list(inputs.named().items()))))
    assert len(sent) == 1, "a refused call sends nothing"
    enc = bls.BlsEncoder("flow_encoder", contract.names(contract.ENCODER_INPUTS),
                                contract.names(contract.ENCODER_OUTPUTS))
    tokens, token_len, embedding = torch.ones(1, 3, dtype=torch.int64), torch.tensor([3]), torch.zeros(1, 192)
    out = enc(tokens, token_len, embedding)
    assert [x.name for x in sent[-1].inputs] == ["tokens", "token_len", "embedding"]
    assert [float(o[0, 0]) for o in out] == [len(n) for n in contract.names(contract.ENCODER_OUTPUTS)]


# ------------------------------------------------------------------------------------------ the stateless shims
@pytest.fixture(scope="module")
def small_flows(tmp_path_factory):
    from s3flow.model.checkpoint import load_flow
    from s3flow.model.random_checkpoint import write_random_checkpoint
    from s3flow.model.flow import FlowConfig
    root = tmp_path_factory.mktemp("flows")
    return {m: load_flow(write_random_checkpoint(root / f"{m}.safetensors", FlowConfig.small(meanflow=m), seed=3))
            for m in (False, True)}


def stateless_config(name: str, kind: str, meanflow: bool, n_feats: int = 80) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    mc.add_tensors(config, *contract.stateless_tensors(kind, meanflow), n_feats=n_feats)
    return config


@pytest.mark.parametrize("shim", ["torch", "onnx"])
@pytest.mark.parametrize("meanflow", [False, True])
def test_the_stateless_shims_serve_the_estimator_by_contract_names(shim, meanflow, small_flows, tmp_path):
    """The torch and ONNX Runtime shims load the estimator the file holds, refuse a config of the other kind,
    and answer as the eager module does (a missing input is that request's INVALID_ARG)."""
    from s3flow.runtime.onnx_export import export_estimator, make_estimator_inputs
    from s3flow.runtime.torch_runner import WEIGHTS_FILE, save_module
    flow = small_flows[meanflow]
    (tmp_path / "1").mkdir()
    if shim == "torch":
        save_module(tmp_path / "1" / WEIGHTS_FILE, "estimator", flow.estimator)
    else:
        export_estimator(flow.estimator, tmp_path / "1" / "model.onnx")
    module = torch_model if shim == "torch" else onnx_model
    model = module.TritonPythonModel()
    with pytest.raises(TritonModelException, match="estimator: config inputs .* differ from the contract's"):
        model.initialize(args_of(stateless_config("estimator", "estimator", not meanflow), tmp_path))
    with pytest.raises(TritonModelException, match=r"estimator: config inputs \['embedding', 'token_len', 'tokens'\] differ"):
        model.initialize(args_of(stateless_config("estimator", "flow_encoder", meanflow), tmp_path))
    model.initialize(args_of(stateless_config("estimator", "estimator", meanflow), tmp_path))
    inputs = make_estimator_inputs(flow.estimator, 2, 24, seed=1)
    with torch.inference_mode():
        want = flow.estimator(**inputs).numpy()
    request = Request({k: v.numpy() for k, v in inputs.items()})
    incomplete = Request({k: v for k, v in request.items() if k != "cond"})
    [good, bad] = model.execute([request, incomplete])
    np.testing.assert_allclose(good.outputs["velocity"], want, atol=1e-4, rtol=0)
    assert bad.error.code == "INVALID_ARG" and "cond" in bad.error.message(), bad.error.message()


def test_the_cached_estimator_runs_the_smallest_graph_a_call_needs(small_flows, tmp_path):
    """The cached graph's extra nodes made a 30 s one request 1.18-1.23x slower (results/stream_work_default.md):
    a call whose rows read no cache and keep nothing (an empty ``past``) runs the plain graph, one that keeps
    nothing (every row's keep 0) the read-only cached graph, each answering an empty ``kept``, and one that keeps
    the cached graph; the velocity is the same."""
    from s3flow.model.prefix_cache import CacheShape, PrefixCache
    from s3flow.runtime.onnx_export import export_estimator, make_estimator_inputs

    flow = small_flows[False]
    (tmp_path / "1").mkdir()
    export_estimator(flow.estimator, tmp_path / "1" / "model.onnx", cached=True)
    export_estimator(flow.estimator, tmp_path / "1" / "plain.onnx")
    export_estimator(flow.estimator, tmp_path / "1" / "read.onnx", cached=True, keeps=False)
    config = mc.ModelConfig(name="estimator", backend="python", max_batch_size=0)
    mc.add_tensors(config, *contract.stateless_tensors("estimator", False, cached=True), n_feats=80)
    mc.set_parameters(config, {"plain_graph": "plain.onnx", "read_graph": "read.onnx"})
    model = onnx_model.TritonPythonModel()
    model.initialize(args_of(config, tmp_path))
    inputs = make_estimator_inputs(flow.estimator, 2, 24, seed=1)
    with torch.inference_mode():
        want = flow.estimator(**inputs).numpy()
    ran = []
    for name in ("session", "plain", "read"):
        real = getattr(model, name)
        setattr(model, name, types.SimpleNamespace(run=lambda *a, real=real, name=name, **kw: ran.append(name) or
                                                   real.run(*a, **kw)))
    shape = CacheShape.of(flow.estimator.config)
    empty_cache = PrefixCache.empty(shape, 2, torch.zeros(1))
    for past, graph in ((np.zeros(0, np.float32), "plain"),
                        (shape.pack_past(empty_cache, torch.zeros(2, dtype=torch.int64)).numpy(), "read"),
                        (shape.pack_past(empty_cache, torch.tensor([3, 2])).numpy(), "session")):
        request = Request({**{k: v.numpy() for k, v in inputs.items()}, "past": past})
        request.outputs = ("velocity", "kept")
        [got] = model.execute([request])
        assert ran[-1] == graph and (got.outputs["kept"].size > 0) == (graph == "session"), (graph, ran)
        np.testing.assert_allclose(got.outputs["velocity"], want, atol=1e-4, rtol=0)
    assert ran == ["plain", "read", "session"]


# ------------------------------------------------------------------------------------------ metrics
def test_background_families_are_published_by_their_own_thread_in_order_and_close_publishes_what_is_queued(
        pb_utils):
    """Each observation is a round trip to Triton: the solver's histograms go out from a thread of its own, off the
    step loop (py-spy: 14 % of the solver's Python where they were published in place); gauges and counters at once;
    ``close`` sends what is still queued before the metrics go."""
    import threading

    from s3flow.serving.metrics import CHUNK_SECONDS, LIVE

    seen, gate = [], threading.Event()

    class Metric:
        def __init__(self, labels, **kw):
            self.name = labels["family"]

        def observe(self, value):
            gate.wait(5)   # Triton is slow to answer: the caller must not wait for it
            seen.append((self.name, value, threading.current_thread().name))

        def set(self, value):
            seen.append((self.name, value, threading.current_thread().name))

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.family = name

        def Metric(self, labels, **kw):  # noqa: N802 (pb_utils' spelling)
            return Metric({**labels, "family": self.family}, **kw)

    pb_utils.MetricFamily = MetricFamily
    metrics = metric_api.TritonMetrics([CHUNK_SECONDS, LIVE], "cfm_solver", "cfm_solver_0", background=[CHUNK_SECONDS])
    me = threading.current_thread().name
    metrics.publish(LIVE, 2, {})
    assert seen == [(LIVE.name, 2.0, me)], "a gauge at once, on the caller's thread"
    t0 = time.monotonic()
    for k in range(3):
        metrics.publish(CHUNK_SECONDS, 0.1 * k, {})
    assert time.monotonic() - t0 < 1.0 and len(seen) == 1, "queued: the caller did not wait for Triton"
    gate.set()
    metrics.close()
    chunks = [x for x in seen if x[0] == CHUNK_SECONDS.name]
    assert [v for _, v, _ in chunks] == pytest.approx([0.0, 0.1, 0.2]) and {t for _, _, t in chunks} != {me}
