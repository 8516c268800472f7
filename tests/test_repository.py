"""Repository generation without a server: the configs are the contract the models check at load time."""
import pytest

from s3flow_contract.tensors import REQUEST, SOLVER_INPUTS, STREAM_RESPONSE, names
from s3flow.engine.settings import SolverSettings
from s3flow.serving.config_params import Params
from s3flow.repository.model_config import to_text
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import Batching, RepositorySettings, TRITON_IDLE_GRACE_S
from s3flow.repository.configs import ensemble_config, solver_config
from tritonclient.grpc import model_config_pb2 as mc


def test_solver_config_carries_every_setting_and_round_trips():
    solver = SolverSettings.of(max_steps=12, idle_timeout_s=7.5, holdback_frames=4, max_live_sequences=10)
    cfg = solver_config(80, False, RepositorySettings(solver=solver, batching=Batching(max_batch_size=4)))
    assert set(SolverSettings.names()) <= set(Params(cfg).raw), "every field a parameter, by its own name"
    assert SolverSettings.from_parameters(Params(cfg).raw) == solver
    assert cfg.max_batch_size == 4 and cfg.sequence_batching.WhichOneof("strategy_choice") == "oldest"
    idle = cfg.sequence_batching.max_sequence_idle_microseconds
    assert idle == int((7.5 + TRITON_IDLE_GRACE_S["cpu"]) * 1e6), "Triton must forget a sequence after the solver"
    kinds = {c.kind for ci in cfg.sequence_batching.control_input for c in ci.control}
    assert kinds == {mc.ModelSequenceBatching.Control.Kind.Value(k) for k in (
        "CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_READY", "CONTROL_SEQUENCE_CORRID")}


def test_triton_idle_grace_is_per_target_and_a_setting():
    """Triton counts a computing chunk as idle: its window is the idle timeout + a grace that outlasts the longest
    chunk (seconds on CPU, milliseconds on a GPU), for the solver and the vocoder alike."""
    solver = SolverSettings.of(idle_timeout_s=5.0)
    def idle(settings):
        return solver_config(80, False, settings).sequence_batching.max_sequence_idle_microseconds
    assert idle(RepositorySettings(solver=solver)) == 35_000_000
    assert idle(RepositorySettings(target="gpu", solver=solver)) == 10_000_000
    assert idle(RepositorySettings(solver=solver, triton_idle_grace_s=12.5)) == 17_500_000
    with pytest.raises(ValueError, match="triton_idle_grace_s must be > 0, got 0"):
        RepositorySettings(triton_idle_grace_s=0).check()


def test_ensemble_has_no_sequence_batching_and_maps_every_tensor():
    cfg = ensemble_config(80, RepositorySettings())
    assert cfg.platform == "ensemble" and not cfg.HasField("sequence_batching")
    assert "sequence_batching" not in to_text(cfg)
    admission, step = cfg.ensemble_scheduling.step   # admission first: the solver waits for its answer
    assert admission.model_name == "admission" and step.model_name == "cfm_solver"
    assert set(admission.input_map) == set(names(REQUEST)) and dict(admission.output_map) == {"admitted": "admitted"}
    for name in ("speech_tokens", "prompt_tokens", "prompt_mel", "speaker_embedding", "n_timesteps",
                 "guidance_rate", "seed", "admitted"):
        assert step.input_map[name] == name
    for name in ("mel", "frame_offset"):
        assert step.output_map[name] == name
    assert set(step.input_map) == set(names(SOLVER_INPUTS)) and set(step.output_map) == set(names(STREAM_RESPONSE))


def test_each_ensemble_asks_admission_for_its_own_output_so_a_start_is_priced_as_what_it_makes():
    """token2mel asks for ``admitted``, token2wav for ``admitted_audio`` (priced with the vocoder's work); both
    feed the solver's ``admitted``."""
    from s3flow.repository.configs import wav_ensemble_config

    mel, wav = (c.ensemble_scheduling.step[0] for c in (ensemble_config(80, RepositorySettings()),
                                                        wav_ensemble_config(80, RepositorySettings())))
    assert dict(mel.output_map) == {"admitted": "admitted"} and dict(wav.output_map) == {"admitted_audio": "admitted"}
    assert wav_ensemble_config(80, RepositorySettings()).ensemble_scheduling.step[1].input_map["admitted"] == "admitted"


def test_live_sequences_above_the_batchers_candidates_is_refused(tmp_path):
    settings = RepositorySettings(solver=SolverSettings.of(max_live_sequences=100),
                                  batching=Batching(max_candidate_sequences=64))
    with pytest.raises(ValueError, match=r"max_live_sequences \(100\) must be below max_candidate_sequences \(64\)"):
        write_repository(tmp_path, flow=None, settings=settings)
