"""Snapshots and resent chunks without a server: the sealed container, the solver's and the vocoder's sections,
a stream resumed from a snapshot against the undisturbed stream, and a chunk sent twice applied once."""
import dataclasses

import numpy as np
import pytest

from helpers import make_engine, small_flow
from s3flow.engine.settings import SolverSettings
from s3flow.engine.snapshot import MAGIC, SnapshotError, SnapshotKey, pack, sections, unpack
from s3flow.engine.solver_snapshot import SolverSnapshots
from s3flow.protocol import RequestError, RequestRules, parse_request
from s3flow_client.demo import demo_utterance

KEY = SnapshotKey(b"0123456789abcdef-fleet")
SIZES = [10, 14, 20, 16, 20]     # 80 tokens: 3.2 s, so the context (C = 40 here) slides


# ------------------------------------------------------------------------------------------ the container
def test_a_payload_comes_back_as_it_went():
    mel = np.random.default_rng(0).standard_normal((80, 7)).astype(np.float32)
    fields, arrays = unpack(pack({"emitted": 12, "rate": 0.7, "digest": "ab"},
                                 {"mel": mel, "tokens": np.arange(5, dtype=np.int16), "empty": np.zeros((80, 0),
                                                                                                        np.float32)}))
    assert fields == {"emitted": 12, "rate": 0.7, "digest": "ab"}
    assert np.array_equal(arrays["mel"], mel) and arrays["tokens"].dtype == np.int16 and arrays["empty"].shape == (80, 0)
    with pytest.raises(TypeError, match="dtype object"):
        pack({}, {"bad": np.array([b"x"], dtype=object)})


def test_a_seal_holds_only_for_its_key_tenant_kind_and_bytes():
    blob = KEY.seal("solver", pack({"a": 1}, {}), tenant="acme")
    assert KEY.open(blob, "solver", tenant="acme") == pack({"a": 1}, {})
    refusals = {
        "another tenant": lambda: KEY.open(blob, "solver", tenant="other"),
        "another key": lambda: SnapshotKey(b"another key of 16+ bytes").open(blob, "solver", tenant="acme"),
        "a flipped byte": lambda: KEY.open(blob[:-40] + bytes([blob[-40] ^ 1]) + blob[-39:], "solver", tenant="acme"),
        "another kind": lambda: KEY.open(blob, "vocoder", tenant="acme"),
        "truncated": lambda: KEY.open(blob[:-5], "solver", tenant="acme"),
        "not a snapshot": lambda: KEY.open(b"hello", "solver"),
    }
    for what, attempt in refusals.items():
        with pytest.raises(SnapshotError):
            attempt()
            pytest.fail(f"{what} was taken")
    both = KEY.seal("vocoder", pack({}, {}), bound=blob, after=blob)
    assert [k for k, _, _ in sections(both)] == ["solver", "vocoder"] and both.startswith(MAGIC)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SnapshotKey(b"short")


def test_a_malformed_payload_under_a_valid_seal_is_refused_not_parsed_blindly():
    for payload in (b"", b"\x05\x00\x00\x00{bad", pack({}, {"m": np.zeros(4, np.float32)})[:-3]):
        with pytest.raises(SnapshotError, match="malformed"):
            unpack(payload)


# ------------------------------------------------------------------------------------ the solver's section
SOLVER = SolverSettings.of(context_frames=40, prompt_frames=20)


def engine(key=KEY, settings=SOLVER):
    flow = small_flow()
    e = make_engine(flow, settings)
    e.snapshots = SolverSnapshots(key, settings.solving, flow.config.n_feats, flow.config.meanflow)
    return e


def chunk_request(u, k, sizes=SIZES, resume=None, start=None):
    lo = sum(sizes[:k])
    start = k == 0 if start is None else start
    return parse_request(u.request(lo, lo + sizes[k], start=start, resume=resume), start=start,
                         end=k == len(sizes) - 1, rules=RequestRules(), n_feats=80)


def stream(e, u, corr_id=1, chunks=range(len(SIZES)), first_resume=None):
    out = []
    for k in chunks:
        resume = first_resume if k == chunks[0] and first_resume is not None else None
        req = chunk_request(u, k, resume=resume, start=(k == 0 or resume is not None))
        [res] = e.run([e.admit(corr_id, req, tenant="acme")])
        out.append(res)
    return out


def test_a_stream_resumed_from_a_snapshot_on_another_engine_equals_the_undisturbed_one():
    """Chunks 3-5 on a fresh engine from chunk 2's snapshot: the same frames, the same offsets, bit for bit (the
    same solves from the same state), and the restored state is the state the first engine had."""
    u = demo_utterance(3.2, seed=7, noise_seed=3)
    whole = stream(engine(), u)
    first = engine()
    head = stream(first, u, chunks=range(2))
    snapshot = head[-1].snapshot
    assert snapshot.startswith(MAGIC) and len(snapshot) < 40_000
    other = engine()
    tail = stream(other, u, corr_id=2, chunks=range(2, 5), first_resume=snapshot)
    for got, want in zip(head + tail, whole):
        assert got.frame_offset == want.frame_offset and np.array_equal(got.mel, want.mel)
    assert sum(r.mel.shape[1] for r in head + tail) == 2 * len(u.speech_tokens)
    # the state a snapshot restores is the state it was made from
    state = first.sequences.peek(1)
    fresh = dataclasses.replace(state, tokens=None, received_tokens=0, token_offset=0, emitted=0, mel_tail=None,
                                noised_mels=None)
    first.snapshots.restore(fresh, snapshot)
    assert np.array_equal(fresh.tokens, state.tokens) and np.array_equal(fresh.mel_tail, state.mel_tail)
    assert (fresh.received_tokens, fresh.token_offset, fresh.emitted) == (state.received_tokens, state.token_offset,
                                                                          state.emitted)
    assert fresh.noised_mels.start == state.noised_mels.start
    assert np.array_equal(fresh.noised_mels.values, state.noised_mels.values)   # pinned noise is seed noise


def test_a_stream_that_keeps_what_it_solved_resumes_keeping_anew_every_frame_in_order():
    """keep_solved 2 (docs/streaming.md): a snapshot carries no cache; the resumed stream's first chunk solves
    prompt and context inline and keeps anew. Every frame comes, in order, near the undisturbed stream (not bit for
    bit: the kept frames were solved beside other chunks)."""
    kept = SolverSettings.of(context_frames=40, prompt_frames=20, keep_solved=2)
    u = demo_utterance(3.2, seed=7, noise_seed=3)
    whole = stream(engine(settings=kept), u)
    head = stream(engine(settings=kept), u, chunks=range(2))
    other = engine(settings=kept)
    tail = stream(other, u, corr_id=2, chunks=range(2, 5), first_resume=head[-1].snapshot)
    assert [r.frame_offset for r in head + tail] == [r.frame_offset for r in whole]
    got, want = (np.concatenate([r.mel for r in rs], axis=1) for rs in (head + tail, whole))
    assert got.shape == want.shape == (80, 2 * len(u.speech_tokens))
    other_seed = stream(engine(settings=kept), demo_utterance(3.2, seed=7, noise_seed=4))
    spread = np.abs(np.concatenate([r.mel for r in other_seed], axis=1) - want).mean()
    assert 0 < np.abs(got - want).mean() < 0.5 * spread


def test_a_stream_that_keeps_its_prompt_resumes_as_the_undisturbed_one_by_solving_its_first_chunk_again():
    """keep_solved 1: the snapshot carries the first chunk's tokens (that chunk made the prompt cache); the resumed
    stream's first chunk solves it again on a fresh state before its own solve, reads the same cache, and every
    frame after the resume is the undisturbed stream's, bit for bit. The same snapshot without those tokens (as a
    server of an earlier version made it) resumes as before: every frame in order, not bit for bit."""
    kept = SolverSettings.of(context_frames=40, prompt_frames=20, keep_solved=1)
    u = demo_utterance(3.2, seed=7, noise_seed=3)
    whole = stream(engine(settings=kept), u)
    first = engine(settings=kept)
    head = stream(first, u, chunks=range(2))
    assert np.array_equal(first.sequences.peek(1).cache_tokens, u.speech_tokens[:SIZES[0]])
    other = engine(settings=kept)
    calls = other.estimator_calls
    tail = stream(other, u, corr_id=2, chunks=range(2, 5), first_resume=head[-1].snapshot)
    for got, want in zip(head + tail, whole):
        assert got.frame_offset == want.frame_offset and np.array_equal(got.mel, want.mel)
    steps = SolverSettings().solving.default_steps or 10
    assert other.estimator_calls - calls == 4 * steps, "the replayed first chunk's steps, then the three chunks'"
    more = stream(first, u, chunks=range(2, 4))   # resumed right before the END chunk: the same again
    [last] = stream(engine(settings=kept), u, corr_id=4, chunks=range(4, 5), first_resume=more[-1].snapshot)
    assert last.frame_offset == whole[4].frame_offset and np.array_equal(last.mel, whole[4].mel)
    # without the first chunk's tokens: solved inline, kept anew (near, not equal)
    fields, arrays = unpack(KEY.open(head[-1].snapshot, "solver", tenant="acme"))
    del arrays["cache_tokens"]
    bare = KEY.seal("solver", pack(fields, arrays), tenant="acme")
    inline = stream(engine(settings=kept), u, corr_id=3, chunks=range(2, 5), first_resume=bare)
    assert [r.frame_offset for r in inline] == [r.frame_offset for r in tail]
    assert not np.array_equal(inline[0].mel, tail[0].mel)
    for bad in (np.zeros(0, np.int16), np.full(3, 7000, np.int16), np.zeros(25, np.int16)):   # 24 tokens came
        forged = KEY.seal("solver", pack(fields, {**arrays, "cache_tokens": bad}), tenant="acme")
        with pytest.raises(SnapshotError, match="cache_tokens must be 1 to 24 tokens"):
            engine(settings=kept).admit(5, chunk_request(u, 2, resume=forged, start=True), tenant="acme")


def test_a_state_started_again_holds_what_its_start_set_and_nothing_since():
    """What a replayed first chunk is planned on (``SequenceState.started``): the prompt, the steps, the noise and
    the tenant as the START set them; no tokens, frames, cache or answer since."""
    kept = SolverSettings.of(context_frames=40, prompt_frames=20, keep_solved=1)
    u = demo_utterance(3.2, seed=7, noise_seed=3)
    e = engine(settings=kept)
    stream(e, u, chunks=range(2))
    s = e.sequences.peek(1)
    fresh = s.started()
    assert s.emitted > 0 and s.cache is not None and s.last is not None
    for name in ("prompt_tokens", "prompt_mel", "speaker_embedding", "n_steps", "guidance_rate", "noise",
                 "prompt_noise", "tenant"):
        assert getattr(fresh, name) is getattr(s, name), name
    assert fresh.tenant == "acme"
    assert (fresh.emitted, fresh.received_tokens, fresh.cache, fresh.cache_tokens, fresh.last, fresh.mel_tail) == \
        (0, 0, None, None, None, None) and fresh.tokens.size == 0


def test_a_snapshot_is_refused_with_another_prompt_options_tenant_settings_or_offset():
    u = demo_utterance(3.2, seed=7, noise_seed=3)
    snapshot = stream(engine(), u, chunks=range(2))[-1].snapshot
    e = engine()

    def refused(req, tenant="acme", match=""):
        with pytest.raises(RequestError, match=match):
            e.admit(5, req, tenant=tenant)
        assert 5 not in e.sequences, "a refused resume leaves no state"

    refused(chunk_request(u, 2, resume=snapshot, start=True), tenant="other", match="seal for this tenant")
    other_voice = dataclasses.replace(u, prompt_mel=u.prompt_mel + 0.5)
    refused(chunk_request(other_voice, 2, resume=snapshot, start=True), match="another speaker prompt")
    refused(chunk_request(dataclasses.replace(u, seed=99), 2, resume=snapshot, start=True), match="seed")
    req = chunk_request(u, 2, resume=snapshot, start=True)
    req.token_offset = 3
    refused(req, match="token_offset 3 of a resume START must be the 24 tokens")
    with pytest.raises(SnapshotError, match="context_frames 40 there, 60 here"):
        engine(settings=SolverSettings.of(context_frames=60, prompt_frames=20)).admit(
            5, chunk_request(u, 2, resume=snapshot, start=True), tenant="acme")
    with pytest.raises(SnapshotError, match="no snapshot key"):
        engine(key=None).admit(5, chunk_request(u, 2, resume=snapshot, start=True), tenant="acme")
    with pytest.raises(SnapshotError, match="prefix mode"):
        engine(settings=SolverSettings.of(context_frames=-1, prompt_frames=-1)).admit(
            5, chunk_request(u, 2, resume=snapshot, start=True), tenant="acme")


def test_no_snapshot_in_prefix_mode_without_a_key_or_at_the_end():
    u = demo_utterance(3.2, seed=7)
    assert all(r.snapshot == b"" for r in stream(engine(key=None), u))
    assert all(r.snapshot == b"" for r in stream(engine(settings=SolverSettings.of(context_frames=-1)), u))
    with_key = stream(engine(), u)
    assert all(r.snapshot for r in with_key[:-1]) and with_key[-1].snapshot == b""


# ------------------------------------------------------------------------------------------ resent chunks
def test_a_chunk_sent_twice_is_answered_again_and_applied_once():
    u = demo_utterance(3.2, seed=7, noise_seed=3)
    whole = stream(engine(), u)
    e = engine()
    head = stream(e, u, chunks=range(3))
    again = e.admit(1, chunk_request(u, 2))            # chunk 3's answer was lost: the same answer, no solve
    assert again is head[-1] and e.sequences.peek(1).received_tokens == sum(SIZES[:3])
    assert e.estimator_calls == 3 * 10 and 1 not in e.sequences._in_flight
    rest = stream(e, u, chunks=range(3, 5))
    for got, want in zip(head + rest, whole):
        assert got.frame_offset == want.frame_offset and np.array_equal(got.mel, want.mel)


def test_an_older_chunk_or_a_gap_is_refused_and_the_sequence_goes_on():
    u = demo_utterance(3.2, seed=7)
    e = engine()
    stream(e, u, chunks=range(3))
    with pytest.raises(RequestError, match="token_offset 10 .* was applied already: the sequence has taken 44"):
        e.admit(1, chunk_request(u, 1))
    req = chunk_request(u, 4)
    with pytest.raises(RequestError, match="token_offset 60 leaves a gap: the sequence has taken 44"):
        e.admit(1, req)
    changed = chunk_request(u, 2)
    changed.speech_tokens = changed.speech_tokens[::-1].copy()   # same offset, other tokens: not the same chunk
    with pytest.raises(RequestError, match="was applied already"):
        e.admit(1, changed)
    assert len(stream(e, u, chunks=range(3, 5))) == 2          # the sequence was not in flight after a refusal
