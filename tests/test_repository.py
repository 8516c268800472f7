"""Repository generation without a server: the configs are the contract the models check at load time."""
import re

import pytest

from s3flow.protocol import Limits
from s3flow.serving.repository import (TRITON_IDLE_GRACE_S, Batching, RepositorySettings, ensemble_config,
                               solver_config, write_repository)


def params(config: str) -> dict:
    return dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', config))


def test_solver_config_carries_every_limit_and_round_trips():
    limits = Limits(max_steps=12, idle_timeout_s=7.5, holdback_frames=4, max_live_sequences=10)
    cfg = solver_config(80, False, RepositorySettings(limits=limits, batching=Batching(max_batch_size=4)))
    assert Limits.from_parameters(params(cfg)) == limits
    assert "max_batch_size: 4" in cfg and "oldest {" in cfg
    idle = int(re.search(r"max_sequence_idle_microseconds: (\d+)", cfg).group(1))
    assert idle == int((7.5 + TRITON_IDLE_GRACE_S) * 1e6), "Triton must forget a sequence after the solver"
    for control in ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_READY",
                    "CONTROL_SEQUENCE_CORRID"):
        assert control in cfg


def test_ensemble_has_no_sequence_batching_and_maps_every_tensor():
    cfg = ensemble_config(80, RepositorySettings())
    assert 'platform: "ensemble"' in cfg and "sequence_batching" not in cfg
    for name in ("speech_tokens", "prompt_tokens", "prompt_mel", "speaker_embedding", "n_timesteps",
                 "guidance_rate", "seed", "mel", "frame_offset"):
        assert f'key: "{name}" value: "{name}"' in cfg


def test_live_sequences_above_the_batchers_candidates_is_refused(tmp_path):
    settings = RepositorySettings(limits=Limits(max_live_sequences=100), batching=Batching(max_candidate_sequences=64))
    with pytest.raises(ValueError, match=r"max_live_sequences \(100\) must be below max_candidate_sequences \(64\)"):
        write_repository(tmp_path, flow=None, settings=settings)
