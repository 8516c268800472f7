"""Voices: the registry, the voice_encoder's request handling, START by voice id, and the whole path on a
real tritonserver (references at 16, 24 and 44.1 kHz registered once, utterances streamed by voice id)."""
import os

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from helpers import request_inputs
from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.engine.settings import SolverSettings
from s3flow.protocol import RequestError
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import Batching, RepositorySettings, VoiceSettings
from s3flow.serving.incoming import Incoming
from s3flow.serving.responses import INVALID_ARG
from s3flow.server.triton_server import TritonServer
from s3flow.model.voice import VoiceConfig, VoiceFrontend
from s3flow.serving.voice_registry import UnknownVoice, VoiceRegistry, voice_id_of
from s3flow.serving.voice_service import VoiceService
from s3flow_client import StreamingClient, Utterance
from s3flow_client.demo import demo_utterance
from s3flow_client.voices import list_voices, read_reference, register_prompt, register_voice
from test_session import session
from test_voice_frontend import speechlike


def prompt(seed: int, n: int = 20):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 6561, n).astype(np.int64), rng.standard_normal((2 * n, 80)).astype(np.float32),
            rng.standard_normal(192).astype(np.float32))


# ------------------------------------------------------------------------------------------ registry
def test_a_voice_is_stored_once_under_its_digest_and_read_back_as_start_tensors(tmp_path):
    reg = VoiceRegistry(tmp_path)
    p = prompt(0)
    vid = reg.put(*p)
    assert vid == voice_id_of(*p) == reg.put(*p) and len(reg.voices()) == 1
    assert vid != reg.put(*prompt(1))
    got = reg.get(vid)
    assert got["prompt_tokens"].shape == (1, 20) and got["prompt_mel"].shape == (1, 40, 80)
    assert np.array_equal(got["prompt_mel"][0], p[1]) and np.array_equal(got["speaker_embedding"][0], p[2])


def test_the_registry_evicts_the_least_recently_used_and_says_so(tmp_path):
    reg = VoiceRegistry(tmp_path, max_voices=2)
    a, b = reg.put(*prompt(0)), reg.put(*prompt(1))
    os.utime(tmp_path / f"{a}.npz", (1, 1)), os.utime(tmp_path / f"{b}.npz", (2, 2))
    reg.get(a)                              # a is used: b is now the least recently used
    c = reg.put(*prompt(2))
    assert {v.voice_id for v in reg.voices()} == {a, c}
    with pytest.raises(UnknownVoice, match=rf"voice_id {b} was evicted \(the registry keeps at most 2 voices"):
        reg.get(b)
    with pytest.raises(UnknownVoice, match="voice_id v-0123456789abcdef is not registered on this server"):
        reg.get("v-0123456789abcdef")
    with pytest.raises(UnknownVoice, match="'../../etc' is not a voice id"):
        reg.get("../../etc")
    assert reg.put(*prompt(1)) == b and b in {v.voice_id for v in reg.voices()}  # registered again: back


def test_the_registry_is_bounded_in_bytes(tmp_path):
    one = (tmp_path / "probe")
    VoiceRegistry(one).put(*prompt(0))
    size = next(one.glob("v-*.npz")).stat().st_size
    reg = VoiceRegistry(tmp_path / "reg", max_bytes=int(2.5 * size))
    for seed in range(4):
        reg.put(*prompt(seed))
    assert len(reg.voices()) == 2 and sum(v.bytes for v in reg.voices()) <= 2.5 * size


def test_a_tenant_sees_and_uses_only_its_own_voices(tmp_path):
    reg = VoiceRegistry(tmp_path, secret=b"fleet-secret-0123456789")
    a = reg.put(*prompt(0), tenant="acme")
    assert [v.voice_id for v in reg.voices("acme")] == [a] and reg.voices("beta") == [] and reg.voices() == []
    with pytest.raises(UnknownVoice, match=f"voice_id {a} is not registered on this server for tenant 'beta'"):
        reg.get(a, "beta")
    assert reg.get(a, "acme")["prompt_tokens"].shape == (1, 20)
    b = reg.put(*prompt(0), tenant="beta")            # the same reference registered by another tenant
    assert b != a and reg.get(b, "beta") and [v.voice_id for v in reg.voices("beta")] == [b]


def test_keyed_ids_agree_across_servers_and_cannot_be_derived_without_the_key(tmp_path):
    key = b"fleet-secret-0123456789"
    one, two = VoiceRegistry(tmp_path / "1", secret=key), VoiceRegistry(tmp_path / "2", secret=key)
    assert one.put(*prompt(3), tenant="acme") == two.put(*prompt(3), tenant="acme")   # failover keeps the id
    keyed = one.put(*prompt(3), tenant="acme")
    assert keyed not in {voice_id_of(*prompt(3)), voice_id_of(*prompt(3), "acme"), voice_id_of(*prompt(3), "acme", b"x" * 16)}
    assert VoiceRegistry(tmp_path / "3").put(*prompt(3)) == voice_id_of(*prompt(3))    # no key, no tenant: as before


def test_one_tenant_cannot_evict_another_tenants_voices(tmp_path):
    reg = VoiceRegistry(tmp_path, max_voices=2)
    mine = reg.put(*prompt(0), tenant="quiet")
    for seed in range(1, 6):
        reg.put(*prompt(seed), tenant="noisy")
    assert len(reg.voices("noisy")) == 2 and [v.voice_id for v in reg.voices("quiet")] == [mine]
    assert reg.get(mine, "quiet")


def test_a_python_model_builds_the_registry_its_config_names(tmp_path, monkeypatch):
    """VoiceRegistry.from_params, as cfm_solver, admission and voice_encoder each build it: the folder and bounds
    of the config's parameters (Triton's JSON form), ids keyed with the fleet's voice key; without them this
    server run's folder and the registry's default bounds."""
    from s3flow.serving import voice_registry
    from s3flow.serving.config_params import Params
    from s3flow.serving.keys import VOICE_KEY_ENV

    key = b"fleet-secret-0123456789"
    (tmp_path / "voice.key").write_bytes(key)
    monkeypatch.setenv(VOICE_KEY_ENV, str(tmp_path / "voice.key"))
    given = {"voice_dir": str(tmp_path / "voices"), "max_voices": "3", "max_voice_bytes": "4096"}
    reg = VoiceRegistry.from_params(Params({"name": "m", "parameters": {k: {"string_value": v}
                                                                        for k, v in given.items()}}))
    assert (reg.folder, reg.max_voices, reg.max_bytes, reg.secret) == (tmp_path / "voices", 3, 4096, key)
    assert reg.put(*prompt(3), tenant="acme") == VoiceRegistry(tmp_path / "other", secret=key).put(*prompt(3),
                                                                                                  tenant="acme")
    monkeypatch.delenv(VOICE_KEY_ENV)
    monkeypatch.setattr(voice_registry, "default_dir", lambda: tmp_path / "this-run")
    bare = VoiceRegistry.from_params(Params({"name": "m", "parameters": {"voice_dir": {"string_value": ""}}}))
    assert (bare.folder, bare.max_voices, bare.max_bytes, bare.secret) == (
        tmp_path / "this-run", voice_registry.MAX_VOICES, voice_registry.MAX_VOICE_BYTES, None)
    with pytest.raises(ValueError, match="m: config parameter max_voices must be an integer, got '2.5'"):
        VoiceRegistry.from_params(Params({"name": "m", "parameters": {"max_voices": {"string_value": "2.5"}}}))


def test_a_tenant_header_is_read_from_the_request_parameters():
    from s3flow.protocol import RequestError, tenant_of

    assert tenant_of("") == "" and tenant_of('{"other": "x"}') == ""
    assert tenant_of('{"s3flow-tenant": "spiffe://acme/t1"}') == "spiffe://acme/t1"
    with pytest.raises(RequestError, match="header s3flow-tenant 'a b'"):
        tenant_of('{"s3flow-tenant": "a b"}')


# ------------------------------------------------------------------------------------------ voice_encoder logic
@pytest.fixture(scope="module")
def frontend():
    return VoiceFrontend.random(VoiceConfig.small(), seed=0)


def test_a_reference_is_embedded_registered_and_answered(frontend, tmp_path):
    service = VoiceService(frontend, VoiceRegistry(tmp_path))
    wav = speechlike(24000, 1.5)
    out = service.handle({"wav": wav, "sample_rate": np.array([24000], np.int32)})
    want = frontend.embed(wav, 24000).aligned()
    assert np.array_equal(out["prompt_tokens"], want.prompt_tokens[0])
    assert np.array_equal(out["prompt_mel"], want.prompt_feat[0]) and out["prompt_mel"].shape[0] == 2 * want.prompt_tokens.size
    vid = out["voice_id"][0].decode()
    assert np.array_equal(service.registry.get(vid)["prompt_mel"][0], out["prompt_mel"])
    assert [v.decode() for v in service.handle({"list_voices": np.array([True])})["voice_ids"]] == [vid]


@pytest.mark.parametrize("inputs,message", [
    ({"wav": np.zeros(0, np.float32), "sample_rate": np.array([16000], np.int32)}, r"wav is empty"),
    ({"wav": speechlike(16000, 0.5), "sample_rate": np.array([16000], np.int32)}, r"too short: 0\.500 s"),
    ({"wav": np.tile(speechlike(16000, 1.5), 14), "sample_rate": np.array([16000], np.int32)}, r"too long: 21\.000 s"),
    ({"wav": np.full(24000, np.nan, np.float32), "sample_rate": np.array([16000], np.int32)}, r"24000 NaN or Inf"),
    ({"wav": np.stack([speechlike(16000, 1.5)] * 2, 1), "sample_rate": np.array([16000], np.int32)}, r"mono"),
    ({"wav": (speechlike(16000, 1.5) * 32767).astype(np.int16), "sample_rate": np.array([16000], np.int32)},
     r"integer PCM of dtype int16"),
    ({"wav": speechlike(16000, 1.5), "sample_rate": np.array([12345], np.int32)}, r"unsupported sample_rate 12345"),
    ({"wav": np.zeros(24000, np.float32), "sample_rate": np.array([16000], np.int32)}, r"silent"),
    ({"wav": speechlike(16000, 1.5)}, r"exactly wav and sample_rate"),
    ({"prompt_tokens": prompt(0)[0]}, r"a prompt needs \['prompt_tokens', 'prompt_mel', 'speaker_embedding'\]"),
    (dict(zip(("prompt_tokens", "prompt_mel", "speaker_embedding"), (prompt(0)[0], prompt(0)[1][:7], prompt(0)[2]))),
     r"prompt_mel must have shape \[1, 40, 80\]"),
    ({}, r"nothing to do"),
])
def test_bad_requests_are_refused_naming_the_value(frontend, tmp_path, inputs, message):
    with pytest.raises(RequestError, match=message):
        VoiceService(frontend, VoiceRegistry(tmp_path)).handle(inputs)
    assert not list(tmp_path.glob("v-*.npz"))


# ------------------------------------------------------------------------------------------ START by voice id
def test_a_start_by_voice_id_equals_a_start_with_the_prompt(tmp_path):
    u = demo_utterance(1.0, seed=3)
    reg = VoiceRegistry(tmp_path)
    vid = reg.put(u.prompt_tokens, u.prompt_mel, u.speaker_embedding)
    by_prompt, _ = session()
    by_voice, _ = session()
    by_voice.voices = reg.get
    [a] = by_prompt.handle([Incoming(1, True, True, request_inputs(u, 0, 25, True))])
    inputs = {k: v for k, v in request_inputs(u, 0, 25, True).items()
              if k not in ("prompt_tokens", "prompt_mel", "speaker_embedding")}
    [b] = by_voice.handle([Incoming(1, True, True, {**inputs, "voice_id": np.array([[vid.encode()]], np.object_)})])
    assert np.array_equal(a.result.mel, b.result.mel)
    [unknown] = by_voice.handle([Incoming(2, True, True, {**inputs, "voice_id": np.array([[b"v-0000000000000000"]],
                                                                                          np.object_)})])
    assert unknown.code == INVALID_ARG and "voice_id v-0000000000000000 is not registered" in unknown.error
    [both] = by_voice.handle([Incoming(3, True, True, {**request_inputs(u, 0, 25, True),
                                                        "voice_id": np.array([[vid.encode()]], np.object_)})])
    assert both.code == INVALID_ARG and "either voice_id or the speaker prompt, not both" in both.error


# ------------------------------------------------------------------------------------------ real server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("voices")
    ckpt = write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=5)
    # (admission by capacity off: these tests count a stream's retries, which must be a voice's, never a busy one's)
    settings = RepositorySettings(solver=SolverSettings.of(max_steps=20, utilization_target=0.0),
                                  batching=Batching(max_queue_delay_us=2000), ort_threads=1,
                                  voices=VoiceSettings(max_voices=8))
    write_repository(root / "repo", load_flow(ckpt), settings, voice_checkpoint=ckpt)
    with TritonServer(root / "repo", log_file=root / "server.log", background_stop=True) as srv:
        yield srv


@pytest.mark.server
def test_references_at_three_rates_register_once_and_stream_by_voice_id(server, tmp_path):
    client = StreamingClient(server.grpc_url, timeout_s=120)
    ids = []
    for rate in (16000, 24000, 44100):
        path = tmp_path / f"ref_{rate}.wav"
        _write_wav(path, speechlike(rate, 2.0, seed=rate), rate)
        voice = register_voice(server.grpc_url, *read_reference(path))
        ids.append(voice.voice_id)
        utts = []
        for seed in (0, 1):
            u = demo_utterance(1.0, seed=10 + seed)
            utts.append(voice.utterance(u.speech_tokens, seed=seed, n_timesteps=3))
        by_id = client.synthesize(utts)
        for u in utts:
            u.voice_id = None          # the same prompt sent in full
        by_prompt = client.synthesize(utts)
        for a, b in zip(by_id, by_prompt):
            assert not a.retries and a.mel.shape == (80, 50)
            np.testing.assert_allclose(a.mel, b.mel, atol=1e-5, rtol=0)
    assert len(set(ids)) == 3 and set(ids) <= set(list_voices(server.grpc_url))


@pytest.mark.server
def test_an_unknown_voice_falls_back_to_the_prompt_and_bad_references_are_refused(server):
    u = demo_utterance(1.0, seed=20)
    u.voice_id, u.n_timesteps = "v-00000000000000ff", 3
    [r] = StreamingClient(server.grpc_url, timeout_s=60).synthesize([u])
    assert r.mel.shape == (80, 50) and "is not registered on this server" in r.retries[0]
    for wav, rate, message in [(np.zeros(16000, np.float32), 16000, "wav is silent"),
                               (speechlike(16000, 0.4), 16000, "too short"),
                               (speechlike(16000, 1.5), 12345, "unsupported sample_rate 12345")]:
        with pytest.raises(InferenceServerException, match=message) as info:
            register_voice(server.grpc_url, wav, rate)
        assert "INVALID_ARG" in str(info.value.status())
    # the server goes on: a prompt made elsewhere (e.g. a conds.pt) registers, and streams by its id
    a = register_prompt(server.grpc_url, u.prompt_tokens, u.prompt_mel, u.speaker_embedding)
    assert a.voice_id == voice_id_of(u.prompt_tokens, u.prompt_mel, u.speaker_embedding)
    [again] = StreamingClient(server.grpc_url, timeout_s=60).synthesize([a.utterance(u.speech_tokens, n_timesteps=3)])
    assert not again.retries
    np.testing.assert_allclose(again.mel, r.mel, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    ckpt = write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=5)
    settings = RepositorySettings(solver=SolverSettings.of(max_steps=20, utilization_target=0.0), ort_threads=1,
                                  voices=VoiceSettings(max_voices=8))
    write_repository(root / "repo", load_flow(ckpt), settings, voice_checkpoint=ckpt)
    (root / "voice-key").write_text("fleet-voice-key-0123456789\n")
    with TritonServer(root / "repo", log_file=root / "server.log", tenants=True,
                      env={"S3FLOW_VOICE_KEY_FILE": str(root / "voice-key")}, background_stop=True) as srv:
        yield srv


@pytest.mark.server
def test_a_tenant_never_sees_or_uses_another_tenants_voice(tenant_server):
    from s3flow_client import StreamError
    from s3flow_client.channel import Channel

    url = tenant_server.grpc_url
    acme, beta = Channel(headers={"s3flow-tenant": "acme"}), Channel(headers={"s3flow-tenant": "beta"})
    u = demo_utterance(1.0, seed=30)
    a = register_prompt(url, u.prompt_tokens, u.prompt_mel, u.speaker_embedding, channel=acme)
    assert a.voice_id != voice_id_of(u.prompt_tokens, u.prompt_mel, u.speaker_embedding)   # keyed
    assert a.voice_id in list_voices(url, acme)
    assert a.voice_id not in list_voices(url, beta) and a.voice_id not in list_voices(url)
    by_id = Utterance(u.speech_tokens, None, None, None, n_timesteps=3, voice_id=a.voice_id)
    [ok] = StreamingClient(url, timeout_s=60, channel=acme).synthesize([by_id])
    assert ok.mel.shape == (80, 50) and not ok.retries
    with pytest.raises(StreamError, match=f"voice_id {a.voice_id} is not registered on this server for tenant 'beta'"):
        StreamingClient(url, timeout_s=60, max_retries=1, channel=beta).synthesize([by_id])
    [again] = StreamingClient(url, timeout_s=60, channel=acme).synthesize([by_id])   # the server goes on
    np.testing.assert_allclose(again.mel, ok.mel, atol=1e-5, rtol=0)


def _write_wav(path, samples: np.ndarray, rate: int) -> None:
    import wave
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(rate)
        f.writeframes(np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
