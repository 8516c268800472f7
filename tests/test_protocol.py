"""Request validation without a server: every branch of ``parse_request`` and of the solver's settings
(``RequestRules``, ``SequenceLimits``, ``AdmissionTarget``, ``ChunkSolving``, ``DeadlineSettings`` and ``SolverSettings``, which holds them), and a property
test.

Each rejection must be a ``RequestError`` (the solver maps it to INVALID_ARG) whose message names the bad
value; anything else escaping the parser would fail the whole batch of the model instance. The property
test throws random tensors (dtypes, ranks, shapes, NaN/Inf/huge values) and mutated valid requests at the
parser and at the engine's admission step: only a ChunkRequest / SequenceState or a RequestError may come out.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from s3flow.engine.scheduler import DeadlineSettings
from s3flow.engine.capacity import AdmissionTarget
from s3flow.engine.sequences import SequenceLimits
from s3flow.engine.settings import ChunkSolving, SolverSettings
from s3flow.protocol import INPUT_DTYPES, START_ONLY, ChunkRequest, RequestError, RequestRules, parse_request
from s3flow_contract.tensors import VOCAB_SIZE, XVECTOR_DIM
from s3flow.engine.chunk import SequenceState
from s3flow.engine.streaming import StreamingEngine

N_FEATS = 80
SETTINGS = SolverSettings.of(max_steps=20, max_guidance_rate=5.0, max_utterance_frames=30, max_prompt_tokens=8,
                             context_frames=-1,   # the prefix mode: the one with an utterance cap
                             max_chunk_tokens=16, max_request_bytes=8_000, max_live_sequences=1)
RULES = SETTINGS.rules


def start_inputs(n_speech: int = 5, n_prompt: int = 3, seed: int = 0) -> dict:
    """A valid START request (batch dimension first)."""
    rng = np.random.default_rng(seed)
    return {"speech_tokens": rng.integers(0, VOCAB_SIZE, (1, n_speech), dtype=np.int64),
            "prompt_tokens": rng.integers(0, VOCAB_SIZE, (1, n_prompt), dtype=np.int64),
            "prompt_mel": rng.standard_normal((1, 2 * n_prompt, N_FEATS)).astype(np.float32),
            "speaker_embedding": rng.standard_normal((1, XVECTOR_DIM)).astype(np.float32)}


def parse(inputs, start=True, end=False, rules=RULES):
    return parse_request(inputs, start=start, end=end, rules=rules, n_feats=N_FEATS)


def rejects(inputs, *needles, start=True, end=False, rules=RULES) -> str:
    with pytest.raises(RequestError) as info:
        parse(inputs, start, end, rules)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


# ------------------------------------------------------------------------------------------ valid requests
def test_valid_start_is_parsed_and_the_prompt_mel_turned_channels_major():
    inputs = {**start_inputs(), "n_timesteps": np.array([[7]], np.int32),
              "guidance_rate": np.array([[0.5]], np.float32), "seed": np.array([[42]], np.int64)}
    req = parse(inputs, end=True)
    assert isinstance(req, ChunkRequest) and req.start and req.end
    np.testing.assert_array_equal(req.speech_tokens, inputs["speech_tokens"][0])
    np.testing.assert_array_equal(req.prompt_tokens, inputs["prompt_tokens"][0])
    np.testing.assert_array_equal(req.prompt_mel, inputs["prompt_mel"][0].T)
    assert req.prompt_mel.flags.c_contiguous and req.prompt_mel.shape == (N_FEATS, 6)
    assert (req.n_timesteps, req.guidance_rate, req.seed) == (7, 0.5, 42)


def test_options_default_to_none_and_seed_zero():
    req = parse(start_inputs())
    assert (req.n_timesteps, req.guidance_rate, req.seed) == (None, None, 0)


def test_later_chunk_carries_tokens_only():
    req = parse({"speech_tokens": np.array([[0, VOCAB_SIZE - 1]], np.int64)}, start=False)
    assert not req.start and req.prompt_tokens is None and list(req.speech_tokens) == [0, VOCAB_SIZE - 1]


def test_empty_chunk_is_allowed_on_end_only():
    empty = {"speech_tokens": np.zeros((1, 0), np.int64)}
    assert parse(empty, start=False, end=True).speech_tokens.size == 0
    rejects(empty, "speech_tokens is empty", "only on the END request", start=False)
    rejects({**start_inputs(), **empty}, "speech_tokens is empty")


def test_rules_at_their_edge_are_accepted():
    inputs = {**start_inputs(n_speech=RULES.max_chunk_tokens, n_prompt=RULES.max_prompt_tokens),
              "n_timesteps": np.array([[RULES.max_steps]], np.int32),
              "guidance_rate": np.array([[RULES.max_guidance_rate]], np.float32)}
    assert parse(inputs).n_timesteps == RULES.max_steps


# ------------------------------------------------------------------------------------------ bad requests
def test_unknown_tensor_is_named():
    rejects({**start_inputs(), "temperature": np.ones((1, 1), np.float32)}, "unknown input tensors", "temperature")


def test_request_above_the_byte_limit():
    inputs = start_inputs(n_prompt=8)
    size = sum(v.nbytes for v in inputs.values())
    rejects(inputs, f"request holds {size} bytes", "limit of 4000", rules=RequestRules(max_request_bytes=4000))


def test_speech_tokens_are_required():
    rejects({"seed": np.array([[1]], np.int64)}, "speech_tokens is required", start=False)


WRONG_DTYPE = {np.dtype(np.int64): np.int32, np.dtype(np.int32): np.int64, np.dtype(np.float32): np.float64,
               np.dtype(object): np.float32}


def every_input() -> dict:
    """A START carrying every request tensor (the resume snapshot empty: none)."""
    return {**start_inputs(), "n_timesteps": np.array([[3]], np.int32), "guidance_rate": np.array([[0.5]], np.float32),
            "seed": np.array([[1]], np.int64), "token_offset": np.array([[0]], np.int64),
            "resume": np.array([[b""]], dtype=object), "chunk_steps": np.array([[2]], np.int32)}


@pytest.mark.parametrize("name", list(INPUT_DTYPES))
def test_wrong_dtype_names_tensor_and_dtype(name):
    inputs = every_input()
    bad = WRONG_DTYPE[inputs[name].dtype]
    inputs[name] = np.zeros(inputs[name].shape, bad)
    rejects(inputs, name, f"must be {np.dtype(INPUT_DTYPES[name]).name}", f"got {np.dtype(bad).name}")


@pytest.mark.parametrize("name", list(INPUT_DTYPES))
def test_wrong_rank_names_tensor_and_shape(name):
    inputs = every_input()
    inputs[name] = inputs[name][None]
    rejects(inputs, name, "dimensions", str(list(inputs[name].shape)))


@pytest.mark.parametrize("name", ["speech_tokens", "prompt_tokens", "prompt_mel", "speaker_embedding"])
def test_batch_other_than_one(name):
    inputs = start_inputs()
    inputs[name] = np.concatenate([inputs[name]] * 2)
    rejects(inputs, name, "batch size 1", "got 2")


@pytest.mark.parametrize("name", ["speech_tokens", "prompt_tokens"])
@pytest.mark.parametrize("bad", [VOCAB_SIZE, -1, 2 ** 62, -(2 ** 63)])
def test_token_ids_outside_the_vocabulary(name, bad):
    inputs = start_inputs()
    inputs[name] = inputs[name].copy()
    inputs[name][0, 1] = bad
    rejects(inputs, f"{name} must be in [0, {VOCAB_SIZE})", f"got {bad}")


def test_chunk_above_max_chunk_tokens():
    rejects({"speech_tokens": np.ones((1, 17), np.int64)}, "17 tokens", "max_chunk_tokens 16", start=False)


@pytest.mark.parametrize("name", START_ONLY)
def test_start_only_tensor_on_a_later_chunk(name):
    inputs = every_input()
    rejects({"speech_tokens": inputs["speech_tokens"], name: inputs[name]}, f"['{name}']",
            "only be sent with the sequence's START", start=False)


@pytest.mark.parametrize("missing", [("prompt_tokens",), ("prompt_mel",), ("speaker_embedding",),
                                     ("prompt_tokens", "prompt_mel", "speaker_embedding")])
def test_start_without_the_speaker_prompt(missing):
    inputs = {k: v for k, v in start_inputs().items() if k not in missing}
    rejects(inputs, "START request needs the speaker prompt", f"missing {list(missing)}")


def test_prompt_token_count():
    inputs = {**start_inputs(), "prompt_tokens": np.zeros((1, 0), np.int64),
              "prompt_mel": np.zeros((1, 0, N_FEATS), np.float32)}
    rejects(inputs, "prompt_tokens must hold 1 to 8 tokens, got 0")
    rejects(start_inputs(n_prompt=9), "prompt_tokens must hold 1 to 8 tokens, got 9")


@pytest.mark.parametrize("shape", [(1, 5, N_FEATS), (1, 7, N_FEATS), (1, 6, N_FEATS - 1), (1, N_FEATS, 6)])
def test_prompt_mel_must_be_two_frames_per_prompt_token(shape):
    inputs = {**start_inputs(n_prompt=3), "prompt_mel": np.zeros(shape, np.float32)}
    rejects(inputs, f"prompt_mel must have shape [1, 6, {N_FEATS}]", f"got {list(shape)}")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_prompt_mel_is_counted(value):
    inputs = start_inputs()
    inputs["prompt_mel"] = inputs["prompt_mel"].copy()
    inputs["prompt_mel"][0, [0, 4], 3] = value
    rejects(inputs, "prompt_mel holds 2 NaN or Inf values")


@pytest.mark.parametrize("width", [0, 191, 193, 256])
def test_xvector_width(width):
    inputs = {**start_inputs(), "speaker_embedding": np.ones((1, width), np.float32)}
    rejects(inputs, f"speaker_embedding must have shape [1, {XVECTOR_DIM}]", f"got [1, {width}]")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_xvector(value):
    inputs = start_inputs()
    inputs["speaker_embedding"] = inputs["speaker_embedding"].copy()
    inputs["speaker_embedding"][0, 7] = value
    rejects(inputs, "speaker_embedding holds NaN or Inf")


def test_all_zero_xvector_has_no_direction():
    rejects({**start_inputs(), "speaker_embedding": np.zeros((1, XVECTOR_DIM), np.float32)}, "all zeros")


@pytest.mark.parametrize("steps", [0, -3, 21, 2 ** 31 - 1])
def test_steps_out_of_range(steps):
    rejects({**start_inputs(), "n_timesteps": np.array([[steps]], np.int32)},
            "n_timesteps must be in [1, 20]", f"got {steps}")


@pytest.mark.parametrize("name,value", [("n_timesteps", np.array([[1, 2]], np.int32)),
                                        ("guidance_rate", np.zeros((1, 0), np.float32)),
                                        ("seed", np.array([[1, 2, 3]], np.int64))])
def test_option_must_hold_one_value(name, value):
    rejects({**start_inputs(), name: value}, f"{name} must hold one value", f"got shape {list(value.shape)}")


@pytest.mark.parametrize("rate", [-0.1, 5.5, np.nan, np.inf, -np.inf])
def test_guidance_rate_out_of_range(rate):
    rejects({**start_inputs(), "guidance_rate": np.array([[rate]], np.float32)},
            "guidance_rate must be in [0, 5.0]", f"got {np.float32(rate).item()}")


def test_negative_seed():
    rejects({**start_inputs(), "seed": np.array([[-5]], np.int64)}, "seed must be >= 0, got -5")


# ------------------------------------------------------------------------------------------ solver settings
def test_settings_from_parameters_parse_types_and_ignore_other_keys():
    settings = SolverSettings.from_parameters({"max_steps": "12", "max_guidance_rate": "2.5", "idle_timeout_s": "0.5",
                                               "max_live_sequences": "1e3", "n_feats": "80", "meanflow": "false"})
    assert settings.rules.max_steps == 12 and isinstance(settings.rules.max_steps, int)
    assert settings.sequences.max_live_sequences == 1000 and isinstance(settings.sequences.max_live_sequences, int)
    assert settings.rules.max_guidance_rate == 2.5 and settings.sequences.idle_timeout_s == 0.5
    assert settings.rules.max_chunk_tokens == RequestRules().max_chunk_tokens
    assert settings.solving == ChunkSolving()


def test_settings_round_trip_through_config_strings():
    """What repository.py writes (str of each value) reads back to the same settings, each part too."""
    settings = SolverSettings.of(max_steps=7, idle_timeout_s=2.0, holdback_frames=4, default_guidance_rate=0.0)
    assert (settings.rules.max_steps, settings.sequences.idle_timeout_s, settings.solving.holdback_frames,
            settings.solving.default_guidance_rate) == (7, 2.0, 4, 0.0)
    params = {k: str(v) for k, v in settings.parameters().items()}
    assert SolverSettings.from_parameters(params) == settings
    for part in (settings.rules, settings.sequences, settings.admission, settings.solving, settings.deadlines):
        assert type(part).from_parameters(params) == part


def test_settings_flat_names_are_distinct_across_the_parts():
    """Every field is a config parameter by its own name: no two parts share one."""
    names = SolverSettings.names()
    parts = [RequestRules(), SequenceLimits(), AdmissionTarget(), ChunkSolving(), DeadlineSettings()]
    assert sorted(names) == sorted(k for part in parts for k in vars(part))
    assert names == {k: v for part in parts for k, v in vars(part).items()}, "the defaults"
    assert SolverSettings().parameters() == names
    assert SolverSettings.of(context_frames=-1).replace(max_live_sequences=8) == \
        SolverSettings(solving=ChunkSolving(context_frames=-1), sequences=SequenceLimits(max_live_sequences=8))
    with pytest.raises(TypeError, match=r"unknown solver settings \['max_frames'\]"):
        SolverSettings.of(max_frames=10)


@pytest.mark.parametrize("key,raw,needle", [
    ("max_steps", "ten", "config parameter max_steps must be a number, got 'ten'"),
    ("max_steps", "", "must be a number, got ''"),
    ("max_steps", "2.5", "config parameter max_steps must be an integer, got '2.5'"),
    ("max_live_sequences", "inf", "max_live_sequences must be an integer, got 'inf'"),
    ("max_chunk_tokens", "nan", "max_chunk_tokens must be an integer, got 'nan'"),
    ("max_steps", "0", "request rule max_steps must be > 0, got 0"),
    ("max_request_bytes", "-1", "request rule max_request_bytes must be > 0, got -1"),
    ("idle_timeout_s", "nan", "sequence limit idle_timeout_s must be > 0, got nan"),
    ("idle_timeout_s", "inf", "sequence limit idle_timeout_s must be finite, got inf"),
    ("holdback_frames", "-2", "chunk setting holdback_frames must be >= 0, got -2"),
    ("default_guidance_rate", "-0.5", "chunk setting default_guidance_rate must be >= 0, got -0.5"),
    ("default_steps", "60", "default_steps 60 exceeds max_steps 50"),
    ("default_guidance_rate", "11", "default_guidance_rate 11.0 exceeds max_guidance_rate 10.0"),
    ("prompt_frames", "-3", "chunk setting prompt_frames must be >= -1, got -3"),
    ("slide_prompt", "2", "chunk setting slide_prompt must be 0 or 1, got 2"),
])
def test_settings_from_parameters_errors_name_the_value(key, raw, needle):
    with pytest.raises(ValueError) as info:
        SolverSettings.from_parameters({key: raw})
    assert needle in str(info.value), str(info.value)


def test_settings_check_on_direct_construction():
    with pytest.raises(ValueError, match="sequence limit max_live_sequences must be > 0, got 0"):
        SequenceLimits(max_live_sequences=0).check()
    with pytest.raises(ValueError, match="request rule max_prompt_tokens must be > 0, got 0"):
        RequestRules(max_prompt_tokens=0).check()
    with pytest.raises(ValueError, match="chunk setting context_frames must be >= -1, got -2"):
        ChunkSolving(context_frames=-2).check()
    # the whole is checked when it is made, the rules between the parts too
    with pytest.raises(ValueError, match="sequence limit max_live_sequences must be > 0, got 0"):
        SolverSettings.of(max_live_sequences=0)
    with pytest.raises(ValueError, match="default_steps 8 exceeds max_steps 4"):
        SolverSettings.of(max_steps=4, default_steps=8)
    with pytest.raises(ValueError, match=r"slide_prompt 1 needs bounded context \(context_frames >= 0\)"):
        SolverSettings.of(context_frames=-1, slide_prompt=1)


# ------------------------------------------------------------------------------------------ property test
_DTYPES = [np.int64, np.int32, np.int16, np.uint8, np.uint64, np.float32, np.float64, np.float16, np.bool_,
           np.complex64]
_NAMES = list(INPUT_DTYPES) + ["bogus"]


@st.composite
def any_tensor(draw, name=None):
    """A random array: dtype, rank 0-4, sides 0-6 (often a leading 1), values anywhere (NaN, Inf, huge)."""
    dtype = draw(st.sampled_from(_DTYPES + [INPUT_DTYPES.get(name, np.int64)] * 3))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
    if shape and draw(st.booleans()):
        shape = (1,) + shape[1:]
    return draw(hnp.arrays(dtype, shape))


@st.composite
def random_request(draw):
    """Random tensors under random names; random START / END flags."""
    names = draw(st.lists(st.sampled_from(_NAMES), unique=True, max_size=len(_NAMES)))
    return {name: draw(any_tensor(name)) for name in names}, draw(st.booleans()), draw(st.booleans())


@st.composite
def mutated_request(draw):
    """A valid request (mostly a START) with 0-2 tensors replaced, dropped, or poked with a hostile value."""
    start = draw(st.integers(0, 3)) > 0
    inputs = start_inputs(draw(st.integers(0, 18)), draw(st.integers(1, 9)), seed=draw(st.integers(0, 99)))
    if start:
        if draw(st.booleans()):
            inputs["n_timesteps"] = np.array([[draw(st.integers(-2 ** 31, 2 ** 31 - 1))]], np.int32)
        if draw(st.booleans()):
            inputs["guidance_rate"] = np.array([[draw(st.floats(width=32))]], np.float32)
        if draw(st.booleans()):
            inputs["seed"] = np.array([[draw(st.integers(-2 ** 63, 2 ** 63 - 1))]], np.int64)
    else:
        inputs = {"speech_tokens": inputs["speech_tokens"]}
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(list(inputs) * 3 + _NAMES))
        action = draw(st.sampled_from(["replace", "drop", "poke", "poke"]))
        if action == "replace" or name not in inputs:
            inputs[name] = draw(any_tensor(name))
        elif action == "drop":
            del inputs[name]
        elif inputs[name].size:
            value = inputs[name].copy()
            flat = value.reshape(-1)
            i = draw(st.integers(0, flat.size - 1))
            if value.dtype.kind == "f":
                flat[i] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 3e38, -3e38, 0.0]))
            elif value.dtype.kind in "iu":
                info = np.iinfo(value.dtype)
                flat[i] = draw(st.sampled_from([v for v in (info.min, info.max, -1, VOCAB_SIZE, 0)
                                                if info.min <= v <= info.max]))
            else:  # bool and other kinds: flip the element
                flat[i] = not bool(flat[i])
            inputs[name] = value
    return inputs, start, draw(st.booleans())


def _no_op_model(*args, **kwargs):
    raise AssertionError("admission must not run a model")


def check_parsed(req: ChunkRequest, start: bool, end: bool) -> None:
    """Invariants of an accepted request (what the engine relies on)."""
    tokens = req.speech_tokens
    assert tokens.dtype == np.int64 and tokens.ndim == 1 and tokens.size <= RULES.max_chunk_tokens
    assert tokens.size or end
    assert tokens.size == 0 or (0 <= tokens.min() and tokens.max() < VOCAB_SIZE)
    if not start:
        assert req.prompt_tokens is None and req.prompt_mel is None and req.speaker_embedding is None
        return
    assert 1 <= req.prompt_tokens.size <= RULES.max_prompt_tokens
    assert 0 <= req.prompt_tokens.min() and req.prompt_tokens.max() < VOCAB_SIZE
    assert req.prompt_mel.shape == (N_FEATS, 2 * req.prompt_tokens.size) and np.isfinite(req.prompt_mel).all()
    assert req.speaker_embedding.shape == (XVECTOR_DIM,) and np.isfinite(req.speaker_embedding).all()
    assert np.any(req.speaker_embedding)
    assert req.n_timesteps is None or 1 <= req.n_timesteps <= RULES.max_steps
    assert req.guidance_rate is None or 0 <= req.guidance_rate <= RULES.max_guidance_rate
    assert 0 <= req.seed < 2 ** 63


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case=st.one_of(random_request(), mutated_request()), corr_id=st.sampled_from([1, 2]))
def test_random_tensors_give_a_request_or_a_request_error(case, corr_id):
    inputs, start, end = case
    engine = StreamingEngine(_no_op_model, _no_op_model, n_feats=N_FEATS, meanflow=False, solving=SETTINGS.solving,
                             limits=SETTINGS.sequences)
    engine.admit(1, parse(start_inputs(n_speech=2), start=True))  # sequence 1 is live; 2 never started
    try:
        req = parse(inputs, start, end)
    except RequestError as exc:
        assert str(exc)
        event(f"parse: {str(exc).split(' ')[0]}")
        return
    check_parsed(req, start, end)
    try:
        chunk = engine.admit(corr_id, req)
    except RequestError as exc:
        assert str(exc)
        event(f"admit: {str(exc)[:20]}")
        return
    event("admitted")
    assert isinstance(chunk.state, SequenceState) and corr_id in engine.sequences
    assert 2 * (chunk.state.received_tokens + chunk.tokens.size) <= SETTINGS.solving.max_utterance_frames


def test_token_offset_and_resume_are_checked():
    """token_offset: >= 0, and 0 on a START without a snapshot; resume: one BYTES element, on START only, bounded."""
    from s3flow.protocol import MAX_RESUME_BYTES
    rejects({**start_inputs(), "token_offset": np.array([[-1]], np.int64)}, "token_offset must be >= 0, got -1")
    rejects({**start_inputs(), "token_offset": np.array([[5]], np.int64)}, "token_offset of a START must be 0",
            "got 5")
    rejects({"speech_tokens": np.array([[1, 2]], np.int64), "resume": np.array([[b"x"]], dtype=object)},
            "['resume'] may only be sent with the sequence's START", start=False)
    rejects({**start_inputs(), "resume": np.array([[b"x", b"y"]], dtype=object)}, "resume must hold one BYTES")
    rejects({**start_inputs(), "resume": np.array([[b"x" * (MAX_RESUME_BYTES + 1)]], dtype=object)},
            f"resume holds {MAX_RESUME_BYTES + 1} bytes, above {MAX_RESUME_BYTES}")
    req = parse({**start_inputs(), "token_offset": np.array([[7]], np.int64),
                 "resume": np.array([[b"S3FS1..."]], dtype=object)}, start=True)
    assert req.token_offset == 7 and req.resume == b"S3FS1..."
    later = parse({"speech_tokens": np.array([[1, 2]], np.int64), "token_offset": np.array([[40]], np.int64)},
                  start=False)
    assert later.token_offset == 40 and later.resume is None
