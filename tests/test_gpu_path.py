"""The GPU fleet path, checked on a CPU host: repository configs for the gpu target, engine naming and
profiles, the fp16 graph (run in ONNX Runtime), the torch backend's logic, the container and cluster files,
and scripts/gpu_check.py's code paths (``--device cpu --quick``).

What needs a GPU (building and running TensorRT engines, the served GPU repository) is exercised by
scripts/gpu_check.py and scripts/build_engines.py on a GPU host.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import small_flow
from s3flow_contract import tensors as contract
from s3flow.engine.settings import SolverSettings
from s3flow.runtime import tensorrt as tb
from s3flow.runtime.torch_runner import TorchModelSettings, TorchRunner, load_module, save_module
from s3flow.serving.config_params import Params
from s3flow.repository.model_config import read_config
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow.repository.configs import solver_config, stateless_config
from s3flow_client.channel import SEQUENCE_HEADER

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
SOLVER = SolverSettings.of(max_utterance_frames=600, max_prompt_tokens=100)
sys.path.insert(0, str(ROOT / "scripts"))
import build_engines  # noqa: E402  (its command line: parse_args)
from s3flow.repository.backends import read_served_shapes, set_backend  # noqa: E402


# ---------------------------------------------------------------------------------------------------
# repository: gpu target


@pytest.fixture(scope="module")
def gpu_repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_repos")
    flow = small_flow()
    batching = Batching(max_batch_size=4, estimator_instances=2)
    trt = write_repository(root / "trt", flow, RepositorySettings(target="gpu", solver=SOLVER, batching=batching))
    torch_repo = write_repository(root / "torch", flow, RepositorySettings(
        target="gpu", solver=SOLVER, batching=batching, gpu_backend="torch", torch_dtype="bf16"))
    return trt.path, torch_repo.path, flow, batching


def _tensors(config) -> tuple[list, list]:
    """The declared inputs and outputs of a ModelConfig: (name, data type, dims) each."""
    def entries(xs):
        return [(x.name, x.data_type, list(x.dims)) for x in xs]
    return entries(config.input), entries(config.output)


def test_gpu_repository_writes_tensorrt_plan_configs_with_the_cpu_targets_tensors(gpu_repos):
    trt, _, flow, batching = gpu_repos
    cpu = RepositorySettings(target="cpu", solver=SOLVER, batching=batching)
    n_feats = flow.config.n_feats
    for name, instances in (("estimator", 2), ("flow_encoder", 1)):
        config = read_config(trt / name)
        assert config.platform == "tensorrt_plan" and not config.backend
        assert [(g.count, g.kind) for g in config.instance_group] == [(instances, config.instance_group[0].KIND_GPU)]
        assert config.max_batch_size == 0
        assert _tensors(config) == _tensors(stateless_config(name, n_feats, False, cpu, instances)), name
        assert (trt / name / "model.onnx").is_file(), "the engines' ONNX source sits beside the version folder"
        assert not (trt / name / "1" / "model.py").exists()
    solver = read_config(trt / "cfm_solver")
    assert solver.instance_group[0].kind == solver.instance_group[0].KIND_GPU
    assert _tensors(solver) == _tensors(solver_config(n_feats, False, cpu))


def test_gpu_repository_tensor_names_match_the_onnx_sources(gpu_repos):
    onnx = pytest.importorskip("onnx")
    trt = gpu_repos[0]
    for name, inputs, outputs in (("estimator", contract.estimator_inputs(False), contract.ESTIMATOR_OUTPUTS),
                                  ("flow_encoder", contract.ENCODER_INPUTS, contract.ENCODER_OUTPUTS)):
        ins, outs = ([n for n, _, _ in entries] for entries in _tensors(read_config(trt / name)))
        graph = onnx.load(str(trt / name / "model.onnx"), load_external_data=False).graph
        assert ins == [i.name for i in graph.input] == list(contract.names(inputs))
        assert outs == [o.name for o in graph.output] == list(contract.names(outputs))
        profile = tb.profiles_for(read_served_shapes(trt))[name]
        assert list(profile.input_shapes()) == ins, "the profile covers exactly the engine's inputs"


def test_engine_install_places_model_plan_and_records_its_name(gpu_repos, tmp_path):
    import shutil
    trt = shutil.copytree(gpu_repos[0], tmp_path / "repo")
    plan = tmp_path / "x.plan"
    plan.write_bytes(b"not really an engine")
    prof = tb.profiles_for(read_served_shapes(trt))["estimator"]
    res = tb.BuildResult(plan, "estimator__X__trt10.0.0__fp16__b__src0123456789ab.plan", "fp16", prof, "python",
                         "10.0.0", 1.0, False)
    parity = [tb.Parity("estimator fp16 B=2 T=300", 1e-3, 1e-2, True, 2e-2)]
    target = tb.install_engine(res, trt, "estimator", parity)
    assert target == trt / "estimator" / "1" / "model.plan" and target.read_bytes() == plan.read_bytes()
    assert tb.installed_engine(trt, "estimator") == res.name
    assert tb.installed_engine(trt, "flow_encoder") is None
    meta = json.loads((trt / "estimator" / "1" / "engine.json").read_text())
    assert meta["precision"] == "fp16" and meta["parity"][0]["rel_error"] == 1e-3
    assert not list((trt / "estimator" / "1").glob("*.tmp"))


def test_solver_settings_and_profiles_follow_the_repository(gpu_repos):
    st = read_served_shapes(gpu_repos[0])
    assert (st.max_batch, st.n_feats, st.meanflow) == (4, 80, False)
    assert st.max_utterance_frames == 600 and st.max_prompt_tokens == 100
    profs = tb.profiles_for(st)
    # guided: one 2B estimator call per step; B = 1 for guidance rate 0; frames = prompt + generated
    assert profs["estimator"].batch == (1, 2, 8) and profs["estimator"].length == (2, 300, 800)
    assert profs["flow_encoder"].batch == (1, 1, 4) and profs["flow_encoder"].length == (1, 150, 400)


def test_torch_backend_repository(gpu_repos):
    _, repo, flow, _ = gpu_repos
    for name, dtype in (("estimator", "bf16"), ("flow_encoder", "fp32")):
        config = read_config(repo / name)
        assert config.backend == "python" and not config.platform
        assert config.instance_group[0].kind == config.instance_group[0].KIND_GPU
        params = Params(config)
        assert params.str("dtype") == dtype and params.str("FORCE_CPU_ONLY_INPUT_TENSORS") == "no"
        assert "s3flow.serving.triton_models.torch_model" in (repo / name / "1" / "model.py").read_text()
    kind, module = load_module(repo / "estimator" / "1" / "model.pt")
    assert kind == "estimator"
    from s3flow.runtime.onnx_export import make_estimator_inputs
    inputs = make_estimator_inputs(flow.estimator, 2, 40, seed=3)
    with torch.inference_mode():
        assert torch.equal(module(**inputs), flow.estimator(**inputs))
    kind, enc = load_module(repo / "flow_encoder" / "1" / "model.pt")
    assert kind == "flow_encoder" and type(enc).__name__ == "FlowEncoder"


def test_bad_gpu_backend_is_refused(tmp_path):
    with pytest.raises(ValueError, match="gpu_backend"):
        write_repository(tmp_path, small_flow(), RepositorySettings(target="gpu", gpu_backend="onnx"))


def test_gpu_target_vocoder_runs_hift_in_torch_on_the_gpu(tmp_path):
    """The vocoder of each target and vocoder_backend: instance kind, parameters and weight files."""
    from s3flow.model.vocoder import VocoderConfig, load_vocoder, random_vocoder
    from s3flow.runtime.vocoder_runner import VocoderRunnerSettings
    from s3flow.repository.model_config import to_text
    from s3flow.repository.generator import write_vocoder_models

    hift = random_vocoder(VocoderConfig.small(), seed=2)
    written, contracts = {}, set()
    for target, backend in (("gpu", "auto"), ("gpu", "onnx"), ("cpu", "auto"), ("cpu", "torch")):
        out = tmp_path / f"{target}_{backend}"
        files = write_vocoder_models(out, hift, 80, RepositorySettings(target=target, solver=SOLVER,
                                                                       vocoder_backend=backend))
        config = read_config(out / "vocoder")
        [group] = config.instance_group
        kind = type(group).Kind.Name(group.kind)
        assert group.count == 1
        params = Params(config).raw
        names = sorted(f.name for f in (out / "vocoder" / "1").iterdir() if f.name != "__pycache__")
        written[(target, backend)] = (kind, params["vocoder_backend"], names)
        assert sorted(f.name for f in files if f.parent.name == "1") == names
        # the model reads its placement from these: KIND_GPU -> cuda:<id>, the backend from the parameter
        st = VocoderRunnerSettings.from_args(params, kind.replace("KIND_", ""), 0)
        assert st.device == ("cuda:0" if kind == "KIND_GPU" else "cpu") and st.backend == params["vocoder_backend"]
        contracts.add((str(_tensors(config)), to_text(read_config(out / "token2wav"))))
    assert written == {
        ("gpu", "auto"): ("KIND_GPU", "torch", ["hift.safetensors", "model.py"]),
        ("gpu", "onnx"): ("KIND_CPU", "onnx", ["decoder.onnx", "f0.onnx", "model.py"]),
        ("cpu", "auto"): ("KIND_CPU", "onnx", ["decoder.onnx", "f0.onnx", "model.py"]),
        ("cpu", "torch"): ("KIND_CPU", "torch", ["hift.safetensors", "model.py"]),
    }
    assert len(contracts) == 1, "the vocoder's tensors and token2wav are the same on every target and backend"
    saved = load_vocoder(tmp_path / "gpu_auto" / "vocoder" / "1" / "hift.safetensors")
    assert saved.config == hift.config
    for k, v in hift.state_dict().items():
        assert torch.equal(saved.state_dict()[k], v), k
    with pytest.raises(ValueError, match="vocoder_backend must be"):
        write_vocoder_models(tmp_path / "bad", hift, 80, RepositorySettings(target="gpu", vocoder_backend="trt"))
    assert not (tmp_path / "bad").exists(), "a bad backend is refused before anything is written"


# ---------------------------------------------------------------------------------------------------
# engine names and profiles


def _name(**change):
    prof = tb.estimator_profile(80, False, 8, 4000)
    kw = dict(gpu="NVIDIA H200", compute_capability=(9, 0), trt_version="10.13.3", precision="fp16",
              profile=prof, source_digest="3f2a9c1b7d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4")
    kw.update(change)
    return tb.engine_name(kw.pop("model", "estimator"), **kw)


def test_engine_name_encodes_gpu_tensorrt_precision_profile_and_source():
    base = _name()
    assert base == "estimator__NVIDIA-H200-sm90__trt10.13.3__fp16__b1-2-16_t2-300-4000__src3f2a9c1b7d4e.plan"
    assert base == _name(), "a pure function"
    variants = [_name(gpu="NVIDIA H100 80GB HBM3"), _name(compute_capability=(8, 0)), _name(trt_version="10.13.4"),
                _name(precision="fp32"), _name(profile=tb.estimator_profile(80, False, 4, 4000)),
                _name(profile=tb.estimator_profile(80, False, 8, 4000, opt_frames=600)),
                _name(source_digest="0" * 64), _name(model="flow_encoder",
                                                     profile=tb.encoder_profile(8, 2000))]
    assert len({base, *variants}) == len(variants) + 1, "every field changes the name"
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", v) for v in variants), "safe file names"
    with pytest.raises(ValueError, match="precision"):
        _name(precision="int8")
    with pytest.raises(ValueError, match="source_digest"):
        _name(source_digest="not-hex")
    with pytest.raises(ValueError, match="trt_version"):
        _name(trt_version="latest")


def test_profiles():
    guided = tb.estimator_profile(80, False, max_batch=8, max_frames=4000)
    assert guided.input_shapes()["x"] == ((1, 80, 2), (2, 80, 300), (16, 80, 4000))
    assert guided.input_shapes()["t"] == ((1,), (2,), (16,)) and "r" not in guided.input_shapes()
    mean = tb.estimator_profile(80, True, max_batch=8, max_frames=4000)
    assert mean.batch == (1, 1, 8) and mean.input_shapes()["r"] == ((1,), (1,), (8,))
    enc = tb.encoder_profile(8, 2000)
    assert enc.input_shapes() == {"tokens": ((1, 1), (1, 150), (8, 2000)), "token_len": ((1,), (1,), (8,)),
                                  "embedding": ((1, 192), (1, 192), (8, 192))}
    assert enc.tag() == "b1-1-8_n1-150-2000"
    assert guided.covers(16, 4000) and not guided.covers(17, 300) and not guided.covers(2, 4001)
    defaults = SolverSettings()
    shapes = tb.ServedShapes(max_batch=8, max_prompt_tokens=defaults.rules.max_prompt_tokens,
                             max_utterance_frames=defaults.solving.max_utterance_frames, n_feats=80, meanflow=False)
    assert tb.max_frames(shapes) == 4000 and tb.max_tokens(shapes) == 2000
    with pytest.raises(ValueError, match="positional table"):
        tb.encoder_profile(8, 4000)
    with pytest.raises(ValueError, match="min <= opt <= max"):
        tb.Profile("estimator", (1, 2, 16), (10, 5, 100))


def test_trtexec_command_and_version():
    prof = tb.estimator_profile(80, True, 2, 1000)
    cmd = tb.trtexec_command("/usr/bin/trtexec", "m.onnx", "e.plan", prof, "fp32", workspace_mb=1024)
    assert "--stronglyTyped" in cmd and "--noTF32" in cmd and "--saveEngine=e.plan" in cmd
    assert "--minShapes=x:1x80x2,mask:1x1x2,mu:1x80x2,t:1,spks:1x80,cond:1x80x2,r:1" in cmd
    assert "--maxShapes=x:2x80x1000,mask:2x1x1000,mu:2x80x1000,t:2,spks:2x80,cond:2x80x1000,r:2" in cmd
    assert "--noTF32" not in tb.trtexec_command("t", "m.onnx", "e.plan", prof, "fp16")
    assert tb.parse_trtexec_version("&&&& RUNNING TensorRT.trtexec [TensorRT v101303] # trtexec") == "10.13.3"
    assert tb.parse_trtexec_version("no banner") is None


def test_build_engines_without_tensorrt_says_so(gpu_repos):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: build_engines.py would build for real")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_engines.py"), "--repository",
                          str(gpu_repos[0]), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "estimator: profile b1-2-8_t2-300-800" in run.stdout
    assert "cannot build engines here" in run.stderr


def test_build_engines_falls_back_to_torch_per_model_and_back(gpu_repos, tmp_path):
    """No TensorRT here: --fallback torch switches both models to the torch backend in place (the configs
    then equal the torch target's); set_backend('tensorrt') restores the plan config."""
    import shutil

    from s3flow.model.checkpoint import write_checkpoint
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: build_engines.py would build for real")
    trt, torch_repo, flow, _ = gpu_repos
    repo = tmp_path / "repo"
    shutil.copytree(trt, repo)
    ckpt = write_checkpoint(flow, tmp_path / "ckpt.safetensors")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_engines.py"), "--repository", str(repo),
                          "--checkpoint", str(ckpt), "--fallback", "torch", "--torch-dtype", "bf16"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for model in ("estimator", "flow_encoder"):
        assert (repo / model / "config.pbtxt").read_text() == (torch_repo / model / "config.pbtxt").read_text()
        kind, _ = load_module(repo / model / "1" / "model.pt")
        assert kind == model and (repo / model / "1" / "model.py").is_file()
    assert set_backend(repo, "estimator", "tensorrt") == "estimator: now served by TensorRT"
    assert (repo / "estimator" / "config.pbtxt").read_text() == (trt / "estimator" / "config.pbtxt").read_text()
    assert sorted(p.name for p in (repo / "estimator" / "1").iterdir()) == \
        sorted(p.name for p in (trt / "estimator" / "1").iterdir()), "nothing of the torch backend is left"


# ---------------------------------------------------------------------------------------------------
# fp16 graph and parity arithmetic


def test_fp16_policy_and_clamp():
    assert tb.is_fp32_node("/mid_blocks.0.1.0/attn1/Softmax", "Softmax")
    assert tb.is_fp32_node("/down_blocks.0.0/block1/block/block.2/LayerNormalization", "LayerNormalization")
    assert tb.is_fp32_node("/time_embeddings/Sin", "Sin") and tb.is_fp32_node("/time_mlp/linear_1/Gemm", "Gemm")
    assert not tb.is_fp32_node("/mid_blocks.0.1.0/attn1/MatMul", "MatMul")
    v = tb.clamp_for_fp16(np.array([-1e10, 1e5, -5.0, np.inf, -np.inf], np.float32))
    assert v.tolist() == [-3e4, 3e4, -5.0, np.inf, -np.inf]


@pytest.mark.parametrize("meanflow", [False, True])
def test_fp16_estimator_graph_runs_without_nan_and_within_bound(tmp_path, meanflow):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from s3flow.runtime.onnx_export import export_estimator, make_estimator_inputs

    flow = small_flow(meanflow)
    src = export_estimator(flow.estimator, tmp_path / "est.onnx")
    fp16 = tb.prepare_onnx(src, "fp16", tmp_path)
    model = onnx.load(str(fp16))
    onnx.checker.check_model(model, full_check=True)
    typed = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in list(typed.graph.value_info) + list(typed.graph.input)}
    types.update({i.name: i.data_type for i in typed.graph.initializer})
    float_types = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
    kept = [n for n in typed.graph.node if tb.is_fp32_node(n.name, n.op_type)]
    assert {n.op_type for n in kept} >= {"LayerNormalization", "Softmax", "Sin", "Cos"}
    for node in kept:  # the fp32 islands really read fp32
        assert all(types[i] == onnx.TensorProto.FLOAT for i in node.input if i and types.get(i) in float_types), node.name
    matmuls = [n for n in typed.graph.node if n.op_type == "MatMul" and not tb.is_fp32_node(n.name, n.op_type)]
    assert matmuls and all(types[n.input[0]] == onnx.TensorProto.FLOAT16 for n in matmuls)
    assert [i.type.tensor_type.elem_type for i in typed.graph.output] == [onnx.TensorProto.FLOAT]

    inputs = make_estimator_inputs(flow.estimator, 3, 97, seed=5)
    with torch.inference_mode():
        ref = flow.estimator(**inputs)
    feed = {k: v.numpy() for k, v in inputs.items()}
    out = ort.InferenceSession(str(fp16), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    parity = tb.compare(torch.from_numpy(out), ref, tb.PARITY_BOUNDS["fp16"], "fp16", mask=inputs["mask"])
    assert parity.ok, parity.describe()
    assert parity.rel_error > 1e-6, "the graph really computes in fp16"
    # the trap the clamp avoids: the -1e10 mask bias is -inf in fp16, and (1 - mask) * -inf is NaN
    naive, report = tb.convert_to_fp16(onnx.load(str(src)), limit=float("inf"))
    assert not report.clamped
    onnx.save(naive, str(tmp_path / "naive.onnx"))
    bad = ort.InferenceSession(str(tmp_path / "naive.onnx"), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert not np.isfinite(bad).all()


def test_fp16_encoder_graph(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from s3flow.model.encoder import random_encoder_inputs
    from s3flow.runtime.onnx_export import export_encoder

    flow = small_flow()
    fp16 = tb.prepare_onnx(export_encoder(flow.encoder, tmp_path / "enc.onnx"), "fp16", tmp_path)
    onnx.shape_inference.infer_shapes(onnx.load(str(fp16)), check_type=True, strict_mode=True)
    tokens, token_len, emb = random_encoder_inputs(flow.encoder.config, 3, 29, seed=2)
    with torch.inference_mode():
        mu, mask, spks = flow.encoder(tokens, token_len, emb)
    got = ort.InferenceSession(str(fp16), providers=["CPUExecutionProvider"]).run(
        None, {"tokens": tokens.numpy(), "token_len": token_len.numpy(), "embedding": emb.numpy()})
    assert tb.compare(torch.from_numpy(got[0]), mu, 2e-2, mask=mask).ok
    assert torch.equal(torch.from_numpy(got[1]), mask)
    assert tb.compare(torch.from_numpy(got[2]), spks, 2e-2).ok


def test_compare_fails_on_nan_and_measures_valid_frames_only():
    ref = torch.ones(1, 2, 4)
    mask = torch.tensor([[[1.0, 1.0, 0.0, 0.0]]])
    out = ref.clone()
    out[..., 3] = 100.0  # padding: ignored
    p = tb.compare(out, ref, 1e-3, "x", mask=mask)
    assert p.ok and p.rel_error == 0.0
    out[0, 0, 0] = 1.1
    assert tb.compare(out, ref, 1e-3, mask=mask).rel_error == pytest.approx(0.1 / 2, rel=1e-4)
    out[0, 1, 3] = float("nan")
    p = tb.compare(out, ref, 1.0, mask=mask)
    assert not p.finite and not p.ok and "NaN" in p.describe()
    with pytest.raises(ValueError, match="shape"):
        tb.compare(torch.ones(2), torch.ones(3), 1.0)


def test_parity_checks_run_against_any_engine_callable(tmp_path):
    """check_estimator_engine / check_encoder_engine with ONNX Runtime on the exported graphs standing in for
    engines against the torch modules as the fp32 reference: an independent code path passes its precision's
    bound without being identical; an engine off by 1 % passes the fp16 bound and fails the fp32 one; NaN fails."""
    pytest.importorskip("onnxruntime")
    from s3flow.runtime.onnx_export import export_encoder, export_estimator

    flow = small_flow()
    prof = tb.estimator_profile(80, False, 2, 100, opt_frames=32)
    ref = TorchRunner(flow.estimator, "estimator")
    ort_fp32 = tb.onnxruntime_engine(export_estimator(flow.estimator, tmp_path / "est.onnx"))
    ort_fp16 = tb.onnxruntime_engine(tb.prepare_onnx(tmp_path / "est.onnx", "fp16", tmp_path))

    def scaled(factor: float):
        return lambda **i: {k: v * factor for k, v in ort_fp32(**i).items()}
    with torch.inference_mode():
        fp32 = tb.check_estimator_engine(ort_fp32, ref, prof, "fp32")
        fp16 = tb.check_estimator_engine(ort_fp16, ref, prof, "fp16")
        off_fp32 = tb.check_estimator_engine(scaled(1.01), ref, prof, "fp32")
        off_fp16 = tb.check_estimator_engine(scaled(1.01), ref, prof, "fp16")
        nan = tb.check_estimator_engine(scaled(float("nan")), ref, prof, "fp16")
    assert [c.what for c in fp32] == ["estimator fp32 B=2 T=32", "estimator fp32 B=3 T=81"]
    assert all(c.ok and 0.0 < c.rel_error < 1e-4 for c in fp32), [c.describe() for c in fp32]
    assert all(c.ok and 1e-4 < c.rel_error < tb.PARITY_BOUNDS["fp16"] for c in fp16), [c.describe() for c in fp16]
    assert [c.ok for c in off_fp32] == [False, False] and [c.ok for c in off_fp16] == [True, True]
    assert all(c.rel_error == pytest.approx(0.01, rel=0.05) for c in off_fp32)
    assert [c.ok for c in nan] == [False, False] and not any(c.finite for c in nan)

    eprof = tb.encoder_profile(2, 40, opt_tokens=12)
    enc_ref = TorchRunner(flow.encoder, "flow_encoder")
    enc_ort = tb.onnxruntime_engine(export_encoder(flow.encoder, tmp_path / "enc.onnx"))
    with torch.inference_mode():
        enc = tb.check_encoder_engine(enc_ort, enc_ref, eprof, "fp32")
        bad = tb.check_encoder_engine(lambda **i: {**enc_ort(**i), "mu": enc_ort(**i)["mu"] * 1.01}, enc_ref,
                                      eprof, "fp32")
    assert [c.what for c in enc] == ["encoder mu fp32 B=1 N=12", "encoder spks fp32 B=1",
                                     "encoder mu fp32 B=2 N=40", "encoder spks fp32 B=2"]
    assert all(c.ok for c in enc) and any(c.rel_error > 0 for c in enc), [c.describe() for c in enc]
    assert [c.ok for c in bad] == [False, True, False, True]


# ---------------------------------------------------------------------------------------------------
# torch backend logic


def test_torch_model_settings():
    assert TorchModelSettings.from_args({"dtype": "bf16"}, "GPU", "1") == TorchModelSettings("bf16", "cuda:1")
    assert TorchModelSettings.from_args({}, "CPU", 0) == TorchModelSettings("fp32", "cpu")
    with pytest.raises(ValueError, match="dtype"):
        TorchModelSettings.from_args({"dtype": "int8"}, "GPU", 0)
    with pytest.raises(ValueError, match="instance kind"):
        TorchModelSettings.from_args({}, "TPU", 0)


def test_torch_runner_modes_against_fp32(tmp_path):
    flow = small_flow(meanflow=True)
    from s3flow.runtime.onnx_export import make_estimator_inputs
    inputs = make_estimator_inputs(flow.estimator, 2, 50, seed=7)
    with torch.inference_mode():
        ref = flow.estimator(**inputs)
    path = save_module(tmp_path / "model.pt", "estimator", flow.estimator)
    _, module = load_module(path)
    for dtype, bound in (("fp32", 0.0), ("bf16", 5e-2), ("fp16", 2e-2)):
        runner = TorchRunner(module, "estimator", "cpu", dtype)
        assert runner.input_names[-1] == "r"
        p = tb.compare(runner(**inputs)["velocity"], ref, bound, dtype, mask=inputs["mask"])
        assert p.ok, p.describe()
        assert (p.rel_error == 0.0) == (dtype == "fp32"), "autocast really lowers the precision"
    with pytest.raises(ValueError, match="missing inputs"):
        runner(**{k: v for k, v in inputs.items() if k != "r"})
    enc = TorchRunner(flow.encoder, "flow_encoder", "cpu")
    out = enc(tokens=torch.randint(0, 6561, (2, 9)), token_len=torch.tensor([9, 5]), embedding=torch.randn(2, 192))
    assert set(out) == {"mu", "mask", "spks"} and out["mu"].shape == (2, 80, 18)


# ---------------------------------------------------------------------------------------------------
# container and cluster files


def _yaml():
    return pytest.importorskip("yaml", reason="pyyaml is needed to validate docker/ (test extra)")


def test_dockerfile_pins_the_ngc_image_and_installs_what_serving_needs():
    text = (DOCKER / "Dockerfile").read_text()
    tag = re.search(r"^ARG TRITON_TAG=(\S+)$", text, re.M)
    assert tag and re.fullmatch(r"\d\d\.\d\d", tag.group(1)), "a pinned yy.mm release"
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:\$\{TRITON_TAG\}-py3$", text, re.M)
    assert '"numpy<2"' in text and "torch==${TORCH_VERSION}" in text
    assert "install_tensorrt_python.sh" in text and 'ENTRYPOINT ["/opt/s3flow/docker/entrypoint.sh"]' in text
    for port in ("8000", "8001", "8002"):
        assert port in re.search(r"^EXPOSE (.*)$", text, re.M).group(1)
    compose = _yaml().safe_load((DOCKER / "compose.yaml").read_text())
    assert compose["services"]["triton"]["build"]["args"]["TRITON_TAG"] == tag.group(1)
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    for line in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for src in line.split():
            assert (ROOT / src).exists(), f"COPY {src}: missing from the repository"
            assert f"!{src.split('/')[0]}" in " ".join(ignore), f"COPY {src}: excluded from the build context"


def test_entrypoint_scripts_are_valid_and_use_existing_flags():
    for script in ("entrypoint.sh", "install_tensorrt_python.sh"):
        path = DOCKER / script
        assert os.access(path, os.X_OK), f"{script} must be executable"
        subprocess.run(["bash", "-n", str(path)], check=True)
    text = (DOCKER / "entrypoint.sh").read_text()
    from s3flow.repository import cli as build_repository
    build_repository.parse_args(["--target", "gpu", "--gpu-backend", "torch", "--torch-dtype", "bf16",
                                 "--checkpoint", "c.safetensors", "--output", "r"])
    build_engines.parse_args(["--repository", "r", "--cache", "e", "--checkpoint", "c", "--estimator-precision", "auto"])
    parsers = {"build_repository": build_repository.build_parser(), "build_engines": build_engines.build_parser()}
    calls = re.findall(r"python3 scripts/(\w+)\.py((?:[^\n]*\\\n)*[^\n]*)", text)
    assert sorted(name for name, _ in calls) == sorted(parsers)
    for name, args in calls:   # every flag the entrypoint passes is one the script's parser takes
        for flag in re.findall(r"(--[a-z][a-z-]+)", args):
            assert flag in parsers[name]._option_string_actions, f"entrypoint passes {flag}, which {name} does not take"
    for flag in ("--model-repository", "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002",
                 "shm-default-byte-size", "--cuda-memory-pool-byte-size", "--exit-timeout-secs"):
        assert flag in text


def test_entrypoint_on_a_host_without_tensorrt(tmp_path):
    """docker/entrypoint.sh end to end with a stand-in tritonserver that prints its command line: random
    weights, the gpu repository, no TensorRT here -> both stateless models fall back to the torch backend;
    a second start reuses the repository."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the entrypoint would build engines for real")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tritonserver").write_text('#!/usr/bin/env bash\necho "TRITONSERVER $*"\n')
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "S3FLOW_HOME": str(ROOT),
           "S3FLOW_STATE": str(tmp_path / "state"), "S3FLOW_RANDOM_SIZE": "small",
           "S3FLOW_REPOSITORY_ARGS": "--max-batch-size 4 --no-vocoder --no-check"}
    runs = [subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), "--log-verbose=1"], capture_output=True,
                           text=True, timeout=600, env=env, cwd=tmp_path) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        [cmd] = [line for line in run.stdout.splitlines() if line.startswith("TRITONSERVER ")]
        assert f"--model-repository={tmp_path / 'state' / 'model_repository'}" in cmd
        assert "--metrics-port=8002" in cmd and cmd.endswith("--log-verbose=1")
        assert "estimator: now served by the torch backend (bf16)" in run.stdout
    assert "building the model repository" in runs[0].stdout
    assert "model repository up to date" in runs[1].stdout
    repo = tmp_path / "state" / "model_repository"
    assert 'backend: "python"' in (repo / "estimator" / "config.pbtxt").read_text()
    assert (repo / "flow_encoder" / "1" / "model.pt").is_file()


def test_compose_reserves_a_gpu_shm_and_health():
    svc = _yaml().safe_load((DOCKER / "compose.yaml").read_text())["services"]["triton"]
    assert (DOCKER / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()
    [dev] = svc["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"] and dev["count"] == 1
    shm = svc["shm_size"]
    assert re.fullmatch(r"\d+gb", shm) and int(shm[:-2]) >= 1
    # ready and not draining (s3flow.server.drain ready asks /v2/health/ready on the given HTTP address)
    check = " ".join(svc["healthcheck"]["test"])
    assert "-m s3flow.server.drain ready" in check and "http://127.0.0.1:8000" in check
    assert {"8000:8000", "8001:8001", "8002:8002"} <= set(svc["ports"])
    assert any(v.endswith(":/var/lib/s3flow") for v in svc["volumes"]), "engines survive restarts"


def _k8s():
    yaml = _yaml()
    docs = {}
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[(doc["kind"], doc.get("metadata", {}).get("name"))] = doc
    return docs


def test_k8s_deployment():
    docs = _k8s()
    dep = docs[("Deployment", "s3flow-triton")]
    pod = dep["spec"]["template"]
    [c] = pod["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert ports[c["startupProbe"]["httpGet"]["port"]] == 8000
    # readiness is "ready and not draining", liveness "live and no model dead past its bound" (tests/test_deploy.py
    # checks the probes and the drain in depth)
    assert c["readinessProbe"]["exec"]["command"][:4] == ["python3", "-m", "s3flow.server.drain", "ready"]
    assert c["livenessProbe"]["exec"]["command"][:4] == ["python3", "-m", "s3flow.server.drain", "live"]
    assert c["lifecycle"]["preStop"]["exec"]["command"][:4] == ["python3", "-m", "s3flow.server.drain", "drain"]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8002"
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in vols.values() if "persistentVolumeClaim" in v}
    assert claims <= {n for k, n in docs if k == "PersistentVolumeClaim"}
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_k8s_services_monitoring_and_kustomization():
    docs = _k8s()
    pod_labels = docs[("Deployment", "s3flow-triton")]["spec"]["template"]["metadata"]["labels"]
    svc, headless = docs[("Service", "s3flow-metrics")], docs[("Service", "s3flow-headless")]
    assert headless["spec"]["clusterIP"] == "None"
    for s in (svc, headless):
        assert s["spec"]["selector"].items() <= pod_labels.items()
    mon = docs[("ServiceMonitor", "s3flow")]
    assert mon["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    kust = _yaml().safe_load((DOCKER / "k8s" / "kustomization.yaml").read_text())
    assert all((DOCKER / "k8s" / r).is_file() for r in kust["resources"])


def test_k8s_router_pins_sequences_by_the_clients_header():
    docs = _k8s()
    envoy = _yaml().safe_load(docs[("ConfigMap", "s3flow-router")]["data"]["envoy.yaml"])
    [listener] = [lst for lst in envoy["static_resources"]["listeners"] if lst["name"] == "grpc"]
    [hcm] = [f["typed_config"] for f in listener["filter_chains"][0]["filters"]
             if f["name"] == "envoy.filters.network.http_connection_manager"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert any(r["match"]["path"].endswith("/ModelStreamInfer") for r in routes)
    for route in routes:
        assert route["route"]["hash_policy"] == [{"header": {"header_name": SEQUENCE_HEADER}}]
        assert route["route"]["timeout"] == "0s", "streams must not be cut by a route timeout"
    [cluster] = [c for c in envoy["static_resources"]["clusters"] if c["name"] == "triton"]
    assert cluster["lb_policy"] in ("RING_HASH", "MAGLEV") and cluster["type"] == "STRICT_DNS"
    [ep] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert ep["endpoint"]["address"]["socket_address"]["address"].startswith("s3flow-headless.")
    assert ep["endpoint"]["address"]["socket_address"]["port_value"] == 8001
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/v2/health/ready"
    router = docs[("Deployment", "s3flow-router")]["spec"]["template"]["spec"]
    assert router["volumes"][0]["configMap"]["name"] == "s3flow-router"
    assert docs[("Service", "s3flow-router")]["spec"]["ports"][0]["port"] == listener["address"]["socket_address"]["port_value"]


# ---------------------------------------------------------------------------------------------------
# the one-shot GPU check, on the CPU


def test_gpu_check_quick_on_cpu_writes_its_results(tmp_path):
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # it finds the package by itself
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    names = [c["name"] for c in report["checks"]]
    assert report["ok"] and len(names) == 10, names  # 2 models x 3 modes on the CPU + 2 streamed rows + 2 vocoder
    assert any("bf16" in n for n in names) and any("fp16" in n for n in names) and any("meanflow" in n for n in names)
    assert any("streaming engine" in n for n in names)
    assert any(n.startswith("vocoder (small) on cpu vs CPU fp32") for n in names)
    assert any(n.startswith("token2wav streamed on cpu") for n in names)
    stream = report["data"]["token2wav"]["stream"]
    assert stream["max_abs"] < 1e-6 and stream["first_audio_ms"] is not None and len(stream["chunks"]) > 2
    md = (out / "gpu_check.md").read_text()
    assert "not GPU figures" in md and "## Verdict" in md and "**PASS**" in md
    for section in ("Whole flow", "Streaming engine", "token2wav", "Estimator forward", "Throughput", "TensorRT",
                    "Scaling"):
        assert f"## {section}" in md, section


# ---------------------------------------------------------------------------------------------------
# the torch backend served by a real tritonserver (CPU host: the GPU instance groups turned into CPU ones)


@pytest.mark.server
def test_torch_backend_served_equals_in_process(tmp_path):
    from helpers import make_engine, stream_in_process
    from s3flow.server.triton_server import TritonServer
    from s3flow_client import StreamingClient, chunk_schedule
    from s3flow_client.demo import demo_utterance

    flow = small_flow()
    solver = SolverSettings.of(max_steps=20, max_utterance_frames=400, max_request_bytes=200_000,
                               max_live_sequences=8)
    write_repository(tmp_path / "repo", flow, RepositorySettings(
        target="gpu", solver=solver, gpu_backend="torch", torch_dtype="fp32",
        batching=Batching(max_queue_delay_us=20_000)))
    for config in (tmp_path / "repo").glob("*/config.pbtxt"):  # no GPU here: same models, CPU instances
        config.write_text(config.read_text().replace("kind: KIND_GPU", "kind: KIND_CPU"))
    u = demo_utterance(1.6, seed=31, noise_seed=5)
    u.chunks = chunk_schedule(len(u.speech_tokens), 10, 2.0, 40)
    with TritonServer(tmp_path / "repo", log_file=tmp_path / "server.log", background_stop=True) as server:
        [got] = StreamingClient(server.grpc_url).synthesize([u])
        stats = server.client().get_inference_statistics("estimator").model_stats[0]
    assert got.mel.shape == (80, 2 * len(u.speech_tokens))
    assert int(stats.inference_count) > 0, "the estimator ran as the torch python model"
    # the served torch backend streams exactly what the in-process engine streams (same mode, same settings)
    [local] = stream_in_process(make_engine(flow, solver), [u], [u.chunks], rules=solver.rules)
    np.testing.assert_allclose(got.mel, np.concatenate([r.mel for r in local], 1), atol=5e-4, rtol=0)


def test_gpu_check_streaming_reference_keeps_the_served_prompt_cap(tmp_path):
    """The full-size streaming check conditions on a 100-frame prompt, which the engine caps at 50: the check's
    offline reference must use the kept prompt and its noise (the first H200 run compared against the whole
    prompt and failed at 0.24). Run on the CPU with the full plan's prompt and a small model."""
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", (
        "import sys, dataclasses, torch; sys.argv=['gpu_check']; sys.path.insert(0, 'scripts');"
        "import gpu_check as g;"
        "from s3flow_tools.gpu_check.flows import QUICK, FlowModes, random_flow;"
        "from s3flow_tools.gpu_check.report import Report, environment;"
        "from s3flow.model.flow import FlowConfig;"
        "plan = dataclasses.replace(QUICK, prompt_tokens=50, speech_tokens=20);"
        "rep = Report(device='cpu', plan=plan, env=environment(torch.device('cpu')));"
        "g.streaming_section(rep, FlowModes(random_flow(FlowConfig.small(False), 0), torch.device('cpu')), plan);"
        "print([(c['name'], c['rel_error'], c['ok']) for c in rep.checks]); sys.exit(0 if rep.ok else 1)")],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "streaming engine" in run.stdout
