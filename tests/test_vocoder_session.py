"""The vocoder's session without a server (``s3flow.serving.vocoder_session``): a push computed on a copy, each row of
its failure table, a chunk sent again, and a stream resumed from its snapshot against the undisturbed stream."""
import functools

import numpy as np
import pytest
import torch

from s3flow.engine.sequences import SequenceLimits, SequenceTable
from s3flow.engine.snapshot import SnapshotKey
from s3flow.engine.solver_snapshot import KIND as SOLVER_KIND
from s3flow.engine.snapshot import pack
from s3flow.engine.vocoder_snapshot import VocoderSnapshots
from s3flow.engine.vocoder_stream import StreamSettings, VocoderStream
from s3flow.model.vocoder import VocoderConfig, random_vocoder
from s3flow.runtime.torch_vocoder import TorchVocoder
from s3flow.serving.responses import INTERNAL, INVALID_ARG, UNAVAILABLE
from s3flow.serving.vocoder_session import VocoderIncoming, VocoderSession

KEY = SnapshotKey(b"0123456789abcdef-fleet")
SIZES = [12, 20, 8, 24, 16, 20]
#: a resumed stream's audio against the undisturbed one: the window's excitation is made again from its F0 and
#: phase (float rounding of a longer phase sum), everything after it is the same computation
RESUME_TOL = 1e-6


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=1)
def runner() -> TorchVocoder:
    return TorchVocoder(random_vocoder(VocoderConfig.small(), seed=3))


class Flaky:
    """The runner's networks, failing on demand."""

    def __init__(self):
        self.fail, self.bug = False, False

    def f0(self, mel):
        if self.fail:
            raise RuntimeError("onnxruntime: out of memory")
        if self.bug:   # answers, but not what the stream's own code can use: a bug, not a failed call
            return np.zeros((1, 3, 3))
        return runner().f0(mel)

    def decode(self, mel, harmonics):
        return runner().decode(mel, harmonics)


def mel_of(frames: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((80, frames + 4))
    return (-4.0 + 1.5 * (x[:, :-4] + x[:, 1:-3] + x[:, 2:-2] + x[:, 3:-1] + x[:, 4:]) / np.sqrt(5)).astype(np.float32)


MEL = mel_of(sum(SIZES))
SOLVER_BLOB = KEY.seal(SOLVER_KIND, pack({"stand-in": 1}, {}), tenant="acme")   # what the solver would answer


def session(key=KEY, networks=None):
    networks = networks or Flaky()
    stream = VocoderStream(networks.f0, networks.decode, runner().hift.source_params, StreamSettings(), n_feats=80)
    table = SequenceTable(SequenceLimits(max_live_sequences=8, idle_timeout_s=60.0))
    return VocoderSession(stream, table, VocoderSnapshots(key, stream)), networks


def incoming(k, corr_id=1, start=None, resume=b"", sizes=SIZES, mel=MEL, seed=5):
    lo = sum(sizes[:k])
    inputs = {"mel": mel[None, :, lo:lo + sizes[k]], "frame_offset": np.array([[lo]], np.int64),
              "seed": np.array([[seed]], np.int64), "snapshot": np.array([[SOLVER_BLOB]], dtype=object),
              "resume": np.array([[resume]], dtype=object)}
    return VocoderIncoming(corr_id, k == 0 if start is None else start, k == len(sizes) - 1, inputs)


def run(s, chunks, corr_id=1, first_resume=b""):
    out = []
    for k in chunks:
        resume = first_resume if k == chunks[0] else b""
        o = s.handle(incoming(k, corr_id, start=k == 0 or bool(resume), resume=resume))
        assert o.error is None, o.error
        out.append(o)
    return out


def audio(outcomes) -> np.ndarray:
    return np.concatenate([o.chunk.audio for o in outcomes])


def test_a_stream_resumed_from_its_snapshot_equals_the_undisturbed_one():
    whole = audio(run(session()[0], range(len(SIZES))))
    s, _ = session()
    head = run(s, range(3))
    snapshot = head[-1].snapshot
    assert snapshot.startswith(SOLVER_BLOB) and len(snapshot) - len(SOLVER_BLOB) < 30_000
    other, _ = session()
    tail = run(other, range(3, len(SIZES)), corr_id=2, first_resume=snapshot)
    assert tail[0].chunk.sample_offset == sum(o.chunk.audio.size for o in head)
    got = audio(head + tail)
    assert got.shape == whole.shape and np.abs(got - whole).max() <= RESUME_TOL


def test_a_vocoder_section_is_refused_without_its_solver_section_or_with_another_key():
    s, _ = session()
    snapshot = run(s, range(2))[-1].snapshot
    for blob, why in ((SOLVER_BLOB, "no single 'vocoder' section"),
                      (KEY.seal(SOLVER_KIND, pack({"other": 2}, {}), tenant="acme") + snapshot[len(SOLVER_BLOB):],
                       "seal")):
        o = session()[0].handle(incoming(2, corr_id=3, start=True, resume=blob))
        assert o.code == INVALID_ARG and o.answer.disposition.value == "retry" and o.answer.resend == "replay"
        assert why in o.error
    o = session(key=SnapshotKey(b"another fleet's key!"))[0].handle(incoming(2, corr_id=3, start=True, resume=snapshot))
    assert o.answer.resend == "replay" and "seal" in o.error
    o = session(key=None)[0].handle(incoming(2, corr_id=3, start=True, resume=snapshot))
    assert o.answer.resend == "replay" and "no snapshot key" in o.error
    assert session(key=None)[0].handle(incoming(0)).snapshot == b""       # and it gives none


def test_a_push_computes_on_a_copy_and_a_failed_call_leaves_the_stream_to_send_the_chunk_again():
    whole = audio(run(session()[0], range(len(SIZES))))
    s, networks = session()
    head = run(s, range(2))
    before = s.table.peek(1).state
    networks.fail = True
    o = s.handle(incoming(2))
    assert o.code == UNAVAILABLE and o.answer.disposition.value == "retry" and "as before this chunk" in o.error
    assert s.table.peek(1).state is before and before.received == sum(SIZES[:2])
    networks.fail = False
    rest = run(s, range(2, len(SIZES)))
    assert np.array_equal(audio(head + rest), whole)


def test_a_chunk_sent_again_gets_its_answer_again_and_the_stream_goes_on():
    whole = audio(run(session()[0], range(len(SIZES))))
    s, _ = session()
    head = run(s, range(3))
    again = s.handle(incoming(2))
    assert again.chunk is head[-1].chunk and again.snapshot == head[-1].snapshot and again.work is None
    rest = run(s, range(3, len(SIZES)))
    assert np.array_equal(audio(head + rest), whole)


@pytest.mark.parametrize("row", ["invalid", "gap", "not held", "failed END", "bug"])
def test_every_failure_has_its_disposition_and_leaves_the_stream_as_the_table_says(row):
    s, networks = session()
    run(s, range(2))
    if row == "invalid":
        bad = incoming(2)
        bad.inputs["mel"] = bad.inputs["mel"][:, :79]
        o, disposition, live = s.handle(bad), "fail", True
    elif row == "gap":
        o, disposition, live = s.handle(incoming(3)), "fail", True
    elif row == "not held":
        o, disposition, live = s.handle(incoming(2, corr_id=9)), "resume", True
    elif row == "failed END":
        networks.fail = True
        o, disposition, live = s.handle(incoming(2, sizes=[12, 20, 8])), "resume", False
    else:
        networks.bug = True
        o, disposition, live = s.handle(incoming(2)), "fail", False
    assert o.error and o.answer.disposition.value == disposition and o.answer.sequence in (1, 9)
    assert o.code == {"bug": INTERNAL, "failed END": UNAVAILABLE}.get(row, INVALID_ARG)
    assert (1 in s.table) == live
    if live:   # the stream is as it was: its next chunk goes on
        assert s.handle(incoming(2)).error is None
