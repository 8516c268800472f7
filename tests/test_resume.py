"""A resume costs one chunk, and a chunk sent twice is applied once: two real tritonservers holding one snapshot key.

* A chunk sent again with its ``token_offset`` (plain tritonclient, ``token2mel`` and ``token2wav``) is answered
  again, the same frames and samples at the same offsets, and the stream goes on as if it had come once; an
  older chunk is refused (``fail``) and the stream goes on too.
* Server A is SIGKILLed mid-stream: the client resumes every utterance on B from its last snapshot (no answered
  chunk sent again) and each equals an undisturbed run on B: mel within 1e-5 and audio within 1e-5 for an
  utterance solved alone; several at once within the batched tolerance (2e-4); with the prompt kept
  (``keep_solved`` 1, the cpu target's default) as without.
* A snapshot B cannot use (here: forged) is refused with ``retry, resend=replay``; the client then replays, and
  the utterance is still whole and equal.
"""
import os
import queue
import signal

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from s3flow.engine.settings import SolverSettings
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterances
from s3flow_client.wire import infer_inputs
from s3flow_contract.answers import answer_of
from s3flow_contract.tensors import SAMPLES_PER_FRAME
from s3flow_tools.bench.repos import small_repository

pytestmark = pytest.mark.server
ALONE_TOL, BATCHED_TOL = 1e-5, 2e-4


def make_fleet(root, vocoder: bool = True, **solving):
    """The repository (token2mel and, with ``vocoder``, token2wav; small seeded models) and the fleet's snapshot
    key file."""
    settings = RepositorySettings(solver=SolverSettings.of(max_steps=20, idle_timeout_s=5.0, context_frames=40,
                                                           prompt_frames=20, **solving),
                                  batching=Batching(max_queue_delay_us=2000), ort_threads=1)
    repo = small_repository(root, settings, seed=4, vocoder=vocoder)
    key = root / "snapshot.key"
    key.write_bytes(os.urandom(32).hex().encode())
    return repo, {"S3FLOW_SNAPSHOT_KEY_FILE": str(key)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return make_fleet(tmp_path_factory.mktemp("resume"))


@pytest.fixture(scope="module")
def server_b(fleet):
    repo, env = fleet
    with TritonServer(repo, log_file=repo.parent / "b.log", env=env, background_stop=True) as srv:
        yield srv


def utterances(n: int, seed: int = 60):
    return demo_utterances(n, 3.2, chunk=10, steps=4, seed=seed)   # 8 chunks of 10 tokens


def after_chunks(n: int, action):
    count = iter(range(1, 1 << 30))
    return lambda _: action() if next(count) == n else None


# ------------------------------------------------------------------------------------- a chunk sent twice
def stream_with_repeats(server, model: str, seq_id: int, u, repeat: dict) -> list:
    """Stream ``u`` with plain tritonclient; after chunk k, send chunk ``repeat[k]`` again. Every answer, in order:
    a dict of its tensors, or the error message."""
    events = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    bounds = np.cumsum([0] + list(u.chunks))
    answers = []

    def send(k):
        start, end = k == 0, k == len(u.chunks) - 1
        client.async_stream_infer(model, infer_inputs(u.request(int(bounds[k]), int(bounds[k + 1]), start)),
                                  sequence_id=seq_id, sequence_start=start, sequence_end=end)
        result, error = events.get(timeout=60)
        answers.append(str(error) if error is not None else
                       {t.name: result.as_numpy(t.name) for t in result.get_response().outputs})

    try:
        for k in range(len(u.chunks)):
            send(k)
            if k in repeat:
                send(repeat[k])
    finally:
        client.stop_stream()
        client.close()
    return answers


@pytest.mark.parametrize("model", ["token2mel", "token2wav"])
def test_a_chunk_sent_twice_is_applied_once(server_b, model):
    [u] = utterances(1, seed=80)
    plain = stream_with_repeats(server_b, model, 8100 + len(model), u, {})
    got = stream_with_repeats(server_b, model, 8200 + len(model), u, {2: 2, 4: 1})
    again, older = got[3], got[6]
    assert isinstance(again, dict), again
    for name, value in got[2].items():   # chunk 3's answer again: the same frames (samples) at the same offsets
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    assert isinstance(older, str) and "was applied already" in older and answer_of(older).disposition.value == "fail"
    fresh = [a for i, a in enumerate(got) if i not in (3, 6)]
    for a, b in zip(fresh, plain):   # the stream went on as if every chunk had come once
        for name in ("mel", "frame_offset") + (("audio", "sample_offset") if model == "token2wav" else ()):
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert sum(a["mel"].shape[2] for a in fresh) == 2 * len(u.speech_tokens)


# ---------------------------------------------------------------------------- a resume from the snapshot
def killed_mid_stream(fleet, server_b, model: str, utts, after: int, tmp_path, **client_kw):
    repo, env = fleet
    with TritonServer(repo, log_file=tmp_path / "a.log", env=env) as a:
        client = StreamingClient([a.grpc_url, server_b.grpc_url], model=model, timeout_s=120, **client_kw)
        return client.synthesize(utts, progress=after_chunks(after, lambda: os.killpg(a.pid, signal.SIGKILL)))


@pytest.mark.parametrize("model", ["token2mel", "token2wav"])
def test_a_stream_resumed_from_its_snapshot_replays_nothing_and_equals_an_undisturbed_run(fleet, server_b, model,
                                                                                          tmp_path):
    [u] = utterances(1, seed=90)
    [want] = StreamingClient(server_b.grpc_url, model=model, timeout_s=120).synthesize(utterances(1, seed=90))
    [got] = killed_mid_stream(fleet, server_b, model, [u], 4, tmp_path)
    assert got.error is None and len(got.resumes) == 1, got.resumes
    assert "from the snapshot after chunk 4" in got.resumes[0] and got.replayed_chunks == 0
    assert got.mel.shape == want.mel.shape and np.abs(got.mel - want.mel).max() <= ALONE_TOL
    if model == "token2wav":
        assert got.audio.shape == (SAMPLES_PER_FRAME * got.mel.shape[1],)
        assert np.abs(got.audio - want.audio).max() <= ALONE_TOL
    print(f"\n{model}: resumed on B from the snapshot after chunk 4, 0 chunks replayed; "
          f"mel {np.abs(got.mel - want.mel).max():.1e} from undisturbed")


def test_a_stream_that_keeps_its_prompt_resumes_equal_to_an_undisturbed_run(tmp_path_factory, tmp_path):
    """The cpu target's chunk solving (``keep_solved`` 1, s3flow.repository.settings.DEFAULT_SOLVING): B solves the
    stream's first chunk again from the snapshot's tokens before the resumed chunk, and reads the prompt cache it
    makes (docs/streaming.md)."""
    kept = make_fleet(tmp_path_factory.mktemp("resume_kept"), vocoder=False, keep_solved=1)
    repo, env = kept
    with TritonServer(repo, log_file=tmp_path / "b.log", env=env, background_stop=True) as b:
        [want] = StreamingClient(b.grpc_url, timeout_s=120).synthesize(utterances(1, seed=90))
        [got] = killed_mid_stream(kept, b, "token2mel", utterances(1, seed=90), 4, tmp_path)
    assert got.error is None and len(got.resumes) == 1 and got.replayed_chunks == 0, got.resumes
    assert got.mel.shape == want.mel.shape and np.abs(got.mel - want.mel).max() <= ALONE_TOL
    print(f"\nkeep_solved 1: resumed on B after chunk 4, mel {np.abs(got.mel - want.mel).max():.1e} from undisturbed")


def test_several_streams_resume_from_their_snapshots(fleet, server_b, tmp_path):
    utts = utterances(4)
    want = StreamingClient(server_b.grpc_url, timeout_s=120).synthesize(utterances(4))
    got = killed_mid_stream(fleet, server_b, "token2mel", utts, 10, tmp_path)
    for g, w in zip(got, want):
        assert g.error is None and g.resumes and g.replayed_chunks == 0 and g.replayed_frames == 0
        assert g.mel.shape == w.mel.shape and np.abs(g.mel - w.mel).max() <= BATCHED_TOL


def test_a_snapshot_the_server_cannot_use_is_refused_and_the_client_replays(server_b):
    [u] = utterances(1, seed=95)
    [want] = StreamingClient(server_b.grpc_url, timeout_s=120).synthesize(utterances(1, seed=95))
    # a plain client sends a forged snapshot: refused, naming why, with the replay disposition
    events = queue.Queue()
    client = grpcclient.InferenceServerClient(server_b.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        forged = b"S3FS1" + bytes([6]) + b"solver" + (4).to_bytes(4, "little") + b"\0" * 36
        client.async_stream_infer("token2mel", infer_inputs(u.request(30, 40, True, resume=forged)),
                                  sequence_id=9501, sequence_start=True, sequence_end=False)
        _, error = events.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    answer = answer_of(str(error))
    assert answer.disposition.value == "retry" and answer.resend == "replay" and "seal" in str(error)
    # our client with a forged snapshot in hand: refused, then it replays, and the utterance is whole and equal
    from s3flow_client.resume import Run
    from s3flow_client.state import UtteranceState

    state = UtteranceState(0, u, list(u.chunks), 1e-3)
    c = StreamingClient([server_b.grpc_url], timeout_s=120)
    run = Run(c, [state], None, None)
    state.snapshot = (forged, 3, 2 * 30 - 6, 0)
    run.new_attempt(state, 0)          # as a resume would: START from the (forged) snapshot
    assert state.first_chunk == 3
    run.run()
    result = c._result(state)
    assert result.error is None and any("replaying instead" in r or "replay" in r for r in state.retries)
    assert result.mel.shape == want.mel.shape and np.abs(result.mel - want.mel).max() <= ALONE_TOL
