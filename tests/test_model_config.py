"""Configs as data (s3flow.repository.model_config and the generator that uses it), without a server.

Generated repositories for both targets, with and without meanflow, the vocoder and the voice encoder, are
read back with protobuf's text_format and checked against what the models and Triton need: the contract's
tensors (check_tensors on the JSON form Triton hands a model), the optional / ragged flags, the sequence
controls and idle times, every parameter read back with its type, the instance groups, ensemble maps that
connect existing tensors of the step models, and warm-up samples Triton can feed. Params and check_tensors
are shown to name what is wrong.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf.json_format import MessageToDict

from helpers import small_flow
from s3flow_contract import tensors as contract
from s3flow.engine.sequences import SequenceLimits
from s3flow.engine.settings import SolverSettings
from s3flow.protocol import RequestRules, numbers_from_parameters
from s3flow.serving.config_params import Params, check_tensors
from s3flow.repository.model_config import (ModelConfig, add_tensors, check_ensemble, read_config, to_text,
                                         write_model_folder)
from s3flow.repository.generator import write_flow_configs, write_repository
from s3flow.repository.settings import Batching, RepositorySettings, TRITON_IDLE_GRACE_S, VoiceSettings
from s3flow.repository.configs import stateless_config
from s3flow.repository.warmup_samples import WARMUP_ITERATIONS, add_model_warmup
from tritonclient.grpc import model_config_pb2 as mc

ROOT = Path(__file__).resolve().parents[1]
SOLVER = SolverSettings.of(max_steps=12, idle_timeout_s=7.5, max_live_sequences=10, max_prompt_tokens=100)
KIND = {True: mc.ModelInstanceGroup.KIND_GPU, False: mc.ModelInstanceGroup.KIND_CPU}
#: each case: (settings, meanflow, vocoder, voice encoder)
CASES = {
    "cpu": (RepositorySettings(solver=SOLVER, batching=Batching(
        max_batch_size=4, preferred_batch_sizes=(2, 4), solver_instances=2, estimator_instances=3,
        length_bucket_ratio=1.5), ort_threads=2, voices=VoiceSettings(voice_dir="/v", max_voices=3)),
        False, True, True),
    "cpu_meanflow_direct": (RepositorySettings(solver=SOLVER, batching=Batching(strategy="direct",
                                                                              max_queue_delay_us=0,
                                                                              admission_batching=True),
                                               warmup=False), True, False, False),
    "gpu_tensorrt_meanflow": (RepositorySettings(target="gpu", solver=SOLVER, batching=Batching(
        encoder_instances=2)), True, True, False),
    "gpu_torch": (RepositorySettings(target="gpu", gpu_backend="torch", solver=SOLVER, vocoder_backend="onnx"),
                  False, True, True),
}
#: every model's tensors, as the contract declares them
TENSORS = {"token2mel": (contract.REQUEST, contract.STREAM_RESPONSE),
           "token2wav": (contract.REQUEST, contract.AUDIO_RESPONSE + contract.STREAM_RESPONSE),
           "admission": (contract.REQUEST, contract.ADMISSION_OUTPUTS),
           "cfm_solver": (contract.SOLVER_INPUTS, contract.SOLVER_OUTPUTS),
           "flow_encoder": (contract.ENCODER_INPUTS, contract.ENCODER_OUTPUTS),
           "vocoder": (contract.VOCODER_INPUTS, contract.VOCODER_OUTPUTS),
           "voice_encoder": (contract.VOICE_ENCODER_INPUTS, contract.VOICE_ENCODER_OUTPUTS)}


def tensors_of(model: str, meanflow: bool):
    if model == "estimator":
        return contract.estimator_inputs(meanflow), contract.ESTIMATOR_OUTPUTS
    return TENSORS[model]


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    from s3flow.model.random_checkpoint import write_random_checkpoint
    from s3flow.model.flow import FlowConfig
    from s3flow.model.vocoder import VocoderConfig, random_vocoder

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("model_config")
    voice = write_random_checkpoint(root / "voice.safetensors", FlowConfig.small(), seed=1)
    hift = random_vocoder(VocoderConfig.small(), seed=0)
    out = {}
    for name, (settings, meanflow, vocoder, voice_encoder) in CASES.items():
        write_repository(root / name, small_flow(meanflow), settings, vocoder=hift if vocoder else None,
                         voice_checkpoint=voice if voice_encoder else None)
        out[name] = root / name
    torch.set_num_threads(before)
    return out


def configs(repo: Path) -> dict[str, ModelConfig]:
    return {p.parent.name: read_config(p) for p in sorted(repo.glob("*/config.pbtxt"))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_config_declares_the_contracts_tensors(repos, case):
    settings, meanflow, vocoder, voice = CASES[case]
    found = configs(repos[case])
    assert set(found) == ({"token2mel", "admission", "cfm_solver", "flow_encoder", "estimator"}
                          | ({"token2wav", "vocoder"} if vocoder else set()) | ({"voice_encoder"} if voice else set()))
    for name, config in found.items():
        assert config.name == name
        ins, outs = tensors_of(name, meanflow)
        check_tensors(MessageToDict(config, preserving_proto_field_name=True), ins, outs, n_feats=80)
        flags = {i.name: (i.optional, i.allow_ragged_batch) for i in config.input}
        assert flags == {t.name: (t.optional, t.ragged) for t in ins}, name
        assert read_config(repos[case] / name) == config and to_text(config) == (repos[case] / name /
                                                                                 "config.pbtxt").read_text()


@pytest.mark.parametrize("case", sorted(CASES))
def test_sequence_batching_controls_and_idle_times(repos, case):
    settings, _, vocoder, _ = CASES[case]
    b, found = settings.batching, configs(repos[case])
    # both stateful models: their idle timeout (the solver's capacity) + the target's grace (Triton counts a
    # computing chunk as idle)
    both = int((SOLVER.sequences.idle_timeout_s + TRITON_IDLE_GRACE_S[settings.target]) * 1e6)
    idle = {"cfm_solver": both, "vocoder": both}
    for name, config in found.items():
        if name not in idle:
            assert not config.HasField("sequence_batching"), name
            continue
        seq = config.sequence_batching
        assert seq.max_sequence_idle_microseconds == idle[name]
        controls = {c.name: c.control for c in seq.control_input}
        assert list(controls) == list(contract.CONTROLS)
        for control, kind in zip(contract.CONTROLS, ("START", "END", "READY", "CORRID")):
            [c] = controls[control]
            assert mc.ModelSequenceBatching.Control.Kind.Name(c.kind) == f"CONTROL_SEQUENCE_{kind}"
            if kind == "CORRID":
                assert c.data_type == mc.TYPE_UINT64 and not c.int32_false_true
            else:
                assert list(c.int32_false_true) == [0, 1]
        strategy = seq.WhichOneof("strategy_choice")
        if name == "vocoder":
            assert strategy == "oldest" and seq.oldest.max_queue_delay_microseconds == 0
            assert seq.oldest.max_candidate_sequences == b.max_candidate_sequences
        else:
            assert strategy == b.strategy
            chosen = getattr(seq, strategy)
            assert chosen.max_queue_delay_microseconds == b.max_queue_delay_us
            if strategy == "oldest":
                assert chosen.max_candidate_sequences == b.max_candidate_sequences
                assert tuple(chosen.preferred_batch_size) == b.preferred_batch_sizes
        assert config.max_batch_size == b.max_batch_size


@pytest.mark.parametrize("case", sorted(CASES))
def test_parameters_read_back_with_their_types(repos, case):
    from s3flow.engine.vocoder_stream import SERVED_FIRST_LOOKAHEAD_FRAMES, StreamSettings
    from s3flow.runtime.torch_runner import default_dtype

    settings, meanflow, vocoder, voice = CASES[case]
    found = configs(repos[case])
    solver = Params(found["cfm_solver"])
    assert (solver.int("n_feats"), solver.bool("meanflow"), solver.bool("warmup"), solver.bool("voices")) == (
        80, meanflow, settings.warmup, voice)
    assert solver.float("length_bucket_ratio") == settings.batching.length_bucket_ratio
    assert solver.int("torch_threads") == settings.torch_threads
    assert {solver.str("encoder_model"), solver.str("estimator_model")} <= set(found), "BLS targets exist"
    assert SolverSettings.from_parameters(solver.raw) == SOLVER
    assert (solver.str("voice_dir", ""), solver.int("max_voices"), solver.int("max_voice_bytes")) == (
        settings.voices.voice_dir, settings.voices.max_voices, settings.voices.max_voice_bytes)
    for name in ("flow_encoder", "estimator"):
        params = Params(found[name])
        if settings.target == "cpu":   # the encoder, called between estimator calls, never spins (OrtSettings)
            spinning = {"allow_spinning": "false"} if name == "flow_encoder" else {}
            assert found[name].backend == "python" and params.raw == {"intra_op_threads": str(settings.ort_threads),
                                                                      **spinning}
        elif settings.gpu_backend == "torch":
            assert found[name].backend == "python" and params.raw == {
                "dtype": default_dtype(name, settings.torch_dtype), "FORCE_CPU_ONLY_INPUT_TENSORS": "no"}
        else:
            assert found[name].platform == "tensorrt_plan" and not found[name].backend and not params.raw
        assert found[name].max_batch_size == 0
    if vocoder:
        params = Params(found["vocoder"])
        solving = SOLVER.solving   # the prefix mode's cap; bounded context (the default) has none
        expected = StreamSettings(max_utterance_frames=solving.max_utterance_frames if solving.context_frames < 0 else 0,
                                  first_lookahead_frames=SERVED_FIRST_LOOKAHEAD_FRAMES)
        assert StreamSettings.from_parameters(params.raw) == expected
        assert SequenceLimits.from_parameters(params.raw) == SOLVER.sequences, "the vocoder holds what the solver holds"
        backend = "onnx" if settings.target == "cpu" or settings.vocoder_backend == "onnx" else "torch"
        assert (params.str("vocoder_backend"), params.int("n_feats"), params.bool("warmup")) == (
            backend, 80, settings.warmup)
        assert params.int("intra_op_threads") == settings.ort_threads and params.float("sampling_rate") > 0
    if voice:
        params = Params(found["voice_encoder"])
        assert (params.int("n_feats"), params.int("max_prompt_tokens"), params.int("max_voices")) == (
            80, SOLVER.rules.max_prompt_tokens, settings.voices.max_voices)


@pytest.mark.parametrize("case", sorted(CASES))
def test_instance_groups(repos, case):
    settings, _, vocoder, voice = CASES[case]
    b, gpu = settings.batching, settings.target == "gpu"
    want = {"cfm_solver": (b.solver_instances, KIND[gpu]), "flow_encoder": (b.encoder_instances, KIND[gpu]),
            "estimator": (b.estimator_instances, KIND[gpu]), "admission": (b.admission_instances, KIND[False])}
    if vocoder:
        want["vocoder"] = (1, KIND[gpu and settings.vocoder_backend in ("auto", "torch")])
    if voice:
        want["voice_encoder"] = (1, KIND[False])
    have = {}
    for name, config in configs(repos[case]).items():
        if config.platform == "ensemble":
            assert not config.instance_group, name
            continue
        [group] = config.instance_group
        have[name] = (group.count, group.kind)
    assert have == want


@pytest.mark.parametrize("case", sorted(CASES))
def test_admission_alone_takes_what_is_queued_for_it_in_one_execute(repos, case):
    """``Batching.admission_batching`` (default off): admission's config holds a dynamic batcher with no delay; no
    other model has one (the solver's batching is the sequence batcher's)."""
    settings = CASES[case][0]
    found = configs(repos[case])
    batched = {name for name, config in found.items() if config.HasField("dynamic_batching")}
    assert batched == ({"admission"} if settings.batching.admission_batching else set())
    if batched:
        assert found["admission"].dynamic_batching.max_queue_delay_microseconds == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_ensemble_maps_connect_existing_tensors(repos, case):
    found = configs(repos[case])
    ensembles = [c for c in found.values() if c.platform == "ensemble"]
    assert {c.name for c in ensembles} == {"token2mel"} | ({"token2wav"} if "vocoder" in found else set())
    for config in ensembles:
        check_ensemble(config)
        ensemble_tensors = {t.name: t for t in [*config.input, *config.output]}
        for step in config.ensemble_scheduling.step:
            model = found[step.model_name]
            assert step.model_version == -1 and model.max_batch_size >= config.max_batch_size
            for side, entries in (("input", step.input_map), ("output", step.output_map)):
                declared = {t.name: t for t in getattr(model, side)}
                for key, tensor in entries.items():
                    assert key in declared, f"{config.name} maps {key} to {step.model_name}, which has no such {side}"
                    if tensor in ensemble_tensors:  # same type and shape on both sides of the map
                        theirs, ours = declared[key], ensemble_tensors[tensor]
                        assert (theirs.data_type, list(theirs.dims)) == (ours.data_type, list(ours.dims)), key
            required = {t.name for t in model.input if not t.optional}
            assert required <= set(step.input_map), f"{step.model_name} would miss {required - set(step.input_map)}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_warmup_samples_fit_the_inputs(repos, case):
    settings, meanflow, _, _ = CASES[case]
    for name in ("flow_encoder", "estimator"):
        config = read_config(repos[case] / name)
        if not settings.warmup:
            assert not config.model_warmup and not (repos[case] / name / "warmup").exists()
            continue
        [sample] = config.model_warmup
        assert (sample.batch_size, sample.count) == (1, WARMUP_ITERATIONS)
        declared = {i.name: i for i in config.input}
        assert set(sample.inputs) == set(declared)
        rows = {t.dims[0] for t in sample.inputs.values()}
        assert rows == {1 if name == "flow_encoder" or meanflow else 2}, "one batch size across the inputs"
        for key, spec in sample.inputs.items():
            assert spec.data_type == declared[key].data_type and len(spec.dims) == len(declared[key].dims)
            assert all(d == want or want == -1 for d, want in zip(spec.dims, declared[key].dims)), key
            if spec.input_data_file:
                t = contract.by_name(tensors_of(name, meanflow)[0])[key]
                data = np.frombuffer((repos[case] / name / "warmup" / spec.input_data_file).read_bytes(), t.np_dtype)
                assert data.size == int(np.prod(spec.dims)), key
            else:
                assert spec.random_data or spec.zero_data
        with pytest.raises(ValueError, match="model_warmup already"):
            add_model_warmup(config, 80, meanflow)


def test_stateless_config_for_the_engine_builder():
    gpu = RepositorySettings(target="gpu")
    config = stateless_config("estimator", 80, True, gpu, 2)
    assert config.platform == "tensorrt_plan" and [(g.count, g.kind) for g in config.instance_group] == [
        (2, mc.ModelInstanceGroup.KIND_GPU)]
    assert [i.name for i in config.input] == list(contract.names(contract.estimator_inputs(True)))
    torch_cfg = stateless_config("flow_encoder", 80, True, dataclasses.replace(gpu, gpu_backend="torch"), 1)
    assert torch_cfg.backend == "python" and Params(torch_cfg).str("dtype") == "fp32", "the encoder stays fp32"
    with pytest.raises(ValueError, match="'vocoder'"):
        stateless_config("vocoder", 80, False, gpu, 1)


def test_the_cpu_encoders_onnx_runtime_pool_spins_only_when_asked():
    """``--encoder-spinning`` (RepositorySettings.encoder_spinning) is what the served encoder's session gets: off by
    default (results/encoder_spinning.md: a spinning pool burned 12x the encoder's CPU for nothing measurable)."""
    from s3flow.repository import cli
    assert Params(stateless_config("flow_encoder", 80, False, RepositorySettings(), 1)).bool("allow_spinning") is False
    on = cli.settings_of(cli.parse_args(["--output", "/tmp/unused", "--encoder-spinning"]))
    assert on.encoder_spinning and Params(stateless_config("flow_encoder", 80, False, on, 1)).bool("allow_spinning")
    assert "allow_spinning" not in Params(stateless_config("estimator", 80, False, on, 1)).raw


def test_the_vocoders_onnx_runtime_sessions_spin_only_when_asked():
    """``--vocoder-spinning``: off by default (results/vocoder_spinning.md: token2wav's C 1.26x with it off)."""
    from s3flow.repository import cli
    from s3flow.repository.configs import vocoder_config
    from s3flow.runtime.vocoder_runner import VocoderRunnerSettings
    from s3flow.engine.vocoder_stream import StreamSettings
    from s3flow.model.vocoder_source import SourceParams

    for flags, spinning in (([], False), (["--vocoder-spinning"], True)):
        settings = cli.settings_of(cli.parse_args(["--output", "/tmp/unused", *flags]))
        params = Params(vocoder_config(80, settings, StreamSettings(), SourceParams()))
        assert params.bool("allow_spinning") is spinning
        assert VocoderRunnerSettings.from_args(params.raw).spinning is spinning


def test_torch_dtype_has_one_default():
    from s3flow.runtime.torch_runner import DEFAULT_ESTIMATOR_DTYPE

    from s3flow.repository.cli import parse_args
    assert RepositorySettings().torch_dtype == DEFAULT_ESTIMATOR_DTYPE == parse_args([]).torch_dtype
    config = stateless_config("estimator", 80, False, RepositorySettings(target="gpu", gpu_backend="torch"), 1)
    assert Params(config).str("dtype") == DEFAULT_ESTIMATOR_DTYPE
    with pytest.raises(ValueError, match="torch_dtype must be one of .* got 'fp8'"):
        RepositorySettings(torch_dtype="fp8").check()


def test_the_cached_estimators_warmup_is_a_first_chunks_call():
    """keep_solved: the estimator's warm-up sample reads a one-frame masked cache and keeps half its frames in both
    rows, as a stream's first chunk calls it (without it a new server's first stream paid the graph's first run)."""
    import torch

    from s3flow.model.flow import FlowConfig
    from s3flow.model.prefix_cache import CacheShape
    from s3flow.repository.warmup_samples import estimator_warmup

    shape = CacheShape.of(FlowConfig.small().estimator)
    sample, files = estimator_warmup(80, False, frames=40, cache=shape)
    assert set(sample.inputs) == {t.name for t in contract.estimator_inputs(False, cached=True)}
    assert {tuple(sample.inputs[n].dims)[0] for n in sample.inputs if n != "past"} == {2}
    past = np.frombuffer(files["warmup/past"], np.float32)
    assert list(sample.inputs["past"].dims) == [past.size]
    cache, keep = shape.unpack_past(torch.from_numpy(past.copy()), 2)
    assert cache.frames == 1 and float(cache.mask.sum()) == 0 and keep.tolist() == [20, 20]


def test_a_build_keeps_the_targets_chunk_solving_where_its_flags_name_none():
    """scripts/build_repository.py: the cpu target keeps each stream's prompt with 25 frames of context, the gpu
    target (TensorRT: no cache) nothing with 100; a flag given wins, and prefix mode or a sliding prompt keep
    nothing rather than failing."""
    from s3flow.repository.cli import parse_args, settings_of

    def solving(*argv):
        s = settings_of(parse_args(list(argv))).solver.solving
        return s.keep_solved, s.context_frames

    assert solving() == (1, 25) and solving("--target", "cpu") == (1, 25)
    assert solving("--target", "gpu") == (0, 100) == solving("--target", "gpu", "--gpu-backend", "torch")
    assert solving("--keep-solved", "0") == (0, 25) and solving("--context-frames", "100") == (1, 100)
    assert solving("--keep-solved", "2") == (2, 25) and solving("--context-frames", "-1") == (0, -1)
    assert solving("--slide-prompt", "1") == (0, 25)
    settings_of(parse_args([])).check()


def test_the_sweeps_rewrite_is_the_generators_and_keeps_the_weights(repos, tmp_path):
    import shutil

    repo = shutil.copytree(repos["cpu"], tmp_path / "repo")
    settings = CASES["cpu"][0]
    before = {p: p.read_text() for p in repo.glob("*/config.pbtxt")}
    write_flow_configs(repo, 80, False, settings)
    assert {p: p.read_text() for p in repo.glob("*/config.pbtxt")} == before
    other = dataclasses.replace(settings, batching=Batching(strategy="direct", max_batch_size=2, estimator_instances=3))
    write_flow_configs(repo, 80, False, other)
    solver, estimator = read_config(repo / "cfm_solver"), read_config(repo / "estimator")
    assert solver.sequence_batching.WhichOneof("strategy_choice") == "direct" and solver.max_batch_size == 2
    assert estimator.instance_group[0].count == 3 and len(estimator.model_warmup) == 1
    assert (repo / "estimator" / "1" / "model.onnx").is_file() and (repo / "vocoder" / "config.pbtxt").read_text() == \
        before[repo / "vocoder" / "config.pbtxt"]


# ------------------------------------------------------------------------------------------ the helpers
def _config(**params) -> ModelConfig:
    config = ModelConfig(name="m")
    for k, v in params.items():
        config.parameters[k].string_value = v
    return config


def test_params_read_typed_values_and_name_what_is_wrong():
    config = _config(n="3", x="0.5", flag="TRUE", off="false", s="abc", empty="")
    for p in (Params(config), Params(MessageToDict(config, preserving_proto_field_name=True))):
        assert (p.int("n"), p.float("x"), p.bool("flag"), p.bool("off"), p.str("s")) == (3, 0.5, True, False, "abc")
        assert (p.int("missing", 7), p.bool("empty", False), p.str("missing", "d")) == (7, False, "d")
        with pytest.raises(ValueError, match="m: config parameter missing is required"):
            p.int("missing")
        with pytest.raises(ValueError, match="m: config parameter s must be a number, got 'abc'"):
            p.int("s")
        with pytest.raises(ValueError, match="m: config parameter x must be an integer, got '0.5'"):
            p.int("x")
        with pytest.raises(ValueError, match="m: config parameter s must be a number, got 'abc'"):
            p.float("s")
    for spelling in ("yes", "1", "no", "on"):
        with pytest.raises(ValueError, match=f"m: config parameter b must be true or false, got '{spelling}'"):
            Params(_config(b=spelling)).bool("b")
    assert Params({"parameters": {}}, model="solver").model == "solver"


@pytest.mark.parametrize("raw", ["12", "1e3", "12.0", " 7 ", "2.5", "ten", "nan", "inf", "-3"])
def test_params_and_the_settings_read_a_number_the_same_way(raw):
    """One reader of typed parameters (s3flow.protocol.parameter_number): a python model's ``Params.int`` and
    the settings dataclasses (``NumericSettings.from_parameters``) give the same value, or the same error."""
    def read(how):
        try:
            return how()
        except ValueError as exc:
            return str(exc).removeprefix("m: ")

    by_params = read(lambda: Params(_config(max_steps=raw)).int("max_steps"))
    by_settings = read(lambda: numbers_from_parameters(RequestRules, {"max_steps": raw})["max_steps"])
    assert by_params == by_settings and type(by_params) is type(by_settings), (by_params, by_settings)


def _served(inputs, outputs, n_feats=80, **change) -> dict:
    config = add_tensors(ModelConfig(name="est"), inputs, outputs, n_feats=n_feats)
    for name, (field_name, value) in change.items():
        entry = next(e for e in [*config.input, *config.output] if e.name == name)
        if field_name == "dims":
            del entry.dims[:]
            entry.dims.extend(value)
        else:
            setattr(entry, field_name, value)
    return MessageToDict(config, preserving_proto_field_name=True)


def test_check_tensors_names_the_difference():
    ins, outs = contract.estimator_inputs(False), contract.ESTIMATOR_OUTPUTS
    check_tensors(_served(ins, outs), ins, outs, n_feats=80)
    with pytest.raises(ValueError, match=r"est: input t is TYPE_INT64 \[-1\] in the config, the contract says "
                                         r"TYPE_FP32 \[-1\]"):
        check_tensors(_served(ins, outs, t=("data_type", mc.TYPE_INT64)), ins, outs, n_feats=80)
    with pytest.raises(ValueError, match=r"est: output velocity is TYPE_FP32 \[-1, 100, -1\] in the config, "
                                         r"the contract says TYPE_FP32 \[-1, 80, -1\]"):
        check_tensors(_served(ins, outs, velocity=("dims", [-1, 100, -1])), ins, outs, n_feats=80)
    with pytest.raises(ValueError, match=r"est: input x is TYPE_FP32 \[-1, 80, -1\] in the config, the contract "
                                         r"says TYPE_FP32 \[-1, 100, -1\]"):
        check_tensors(_served(ins, outs), ins, outs, n_feats=100)
    with pytest.raises(ValueError, match=r"est: config inputs \[.*'x'\] differ from the contract's \[.*'r'.*\]"):
        check_tensors(_served(ins, outs), contract.estimator_inputs(True), outs, n_feats=80)   # r is missing
    with pytest.raises(ValueError, match=r"config outputs \['velocity'\] differ from the contract's \[\]"):
        check_tensors(_served(ins, outs), ins, (), n_feats=80)


def test_check_ensemble_names_an_unconnected_tensor():
    from s3flow.repository.configs import wav_ensemble_config

    config = wav_ensemble_config(80, RepositorySettings())
    check_ensemble(config)
    config.ensemble_scheduling.step[2].input_map["mel"] = "mel_typo"
    with pytest.raises(ValueError, match=r"token2wav: step 2 \(vocoder\) reads \['mel_typo'\]"):
        check_ensemble(config)
    config = wav_ensemble_config(80, RepositorySettings())
    del config.ensemble_scheduling.step[2]
    with pytest.raises(ValueError, match=r"token2wav: outputs \['audio', 'frame_offset', 'mel', 'sample_offset', "
                                         r"'snapshot', 'steps'\] are made by no step"):
        check_ensemble(config)


def test_check_ensemble_refuses_an_output_that_is_also_a_steps_input():
    """The layout that made a request naming only 'audio' deadlock (issue 31): the solver's mel both an output of
    token2wav and the vocoder's input."""
    from s3flow.repository.configs import wav_ensemble_config

    config = wav_ensemble_config(80, RepositorySettings())
    solver, vocoder = config.ensemble_scheduling.step[1:]
    assert dict(vocoder.input_map)["mel"] == "solver_mel" and dict(vocoder.output_map)["mel"] == "mel"
    solver.output_map["mel"] = vocoder.input_map["mel"] = "mel"
    del vocoder.output_map["mel"]
    with pytest.raises(ValueError, match=r"token2wav: step 2 \(vocoder\) reads the ensemble outputs \['mel'\]"):
        check_ensemble(config)


def test_write_model_folder_replaces_and_writes_text_and_bytes(tmp_path):
    config = ModelConfig(name="m", backend="python")
    (tmp_path / "m" / "old").mkdir(parents=True)
    written = write_model_folder(tmp_path, config, {"1/model.py": "x = 1\n", "warmup/data": b"\x00\x01"})
    assert written == [tmp_path / "m" / "config.pbtxt", tmp_path / "m" / "1" / "model.py",
                       tmp_path / "m" / "warmup" / "data"]
    assert not (tmp_path / "m" / "old").exists() and (tmp_path / "m" / "warmup" / "data").read_bytes() == b"\x00\x01"
    assert read_config(tmp_path / "m") == config and not (tmp_path / "m" / "1" / ".keep").exists()
    write_model_folder(tmp_path, ModelConfig(name="e", platform="ensemble"))
    assert (tmp_path / "e" / "1" / ".keep").is_file(), "an empty version folder is kept"
