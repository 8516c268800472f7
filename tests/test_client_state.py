"""The client's book-keeping of one utterance (s3flow_client.state): what a listener hears first."""
import numpy as np

from s3flow_client.demo import demo_utterance
from s3flow_contract.tensors import SILENT_START_SAMPLES
from s3flow_client.state import UtteranceState


def test_first_audio_counts_the_first_response_with_sound_not_the_first_response():
    """A response with no samples (the vocoder holds back its lookahead), or with only the silent, faded-in
    first 40 ms, is not first audio; the first response that reaches beyond it is."""
    s = UtteranceState(0, demo_utterance(1.0, seed=1), [10, 15], tolerance=1e-3)
    s.t0 = 100.0
    s.accept_audio(np.zeros(0, np.float32), 0, now=100.1, new_chunk=True)
    assert np.isnan(s.first_audio_at), "an empty response is no audio"
    s.accept_audio(np.zeros(SILENT_START_SAMPLES, np.float32), 0, now=100.2, new_chunk=True)
    assert np.isnan(s.first_audio_at), "the silent first 40 ms are no audio"
    s.accept_audio(np.ones(480, np.float32), SILENT_START_SAMPLES, now=100.35, new_chunk=True)
    assert abs(s.first_audio_at - 0.35) < 1e-9


def test_playback_stalls_follow_the_chunk_arrivals_of_a_stream():
    from s3flow_client.stream import StreamResult

    # responses at 0.2, 0.5 (+0.3), 1.4 (+0.9) s with 0.28 s, 0.4 s, 0.8 s of audio: the player runs dry at 0.48 s
    # (until the second response at 0.5) and at 0.9 s (until 1.4); a 0.6 s start-up buffer covers both
    r = StreamResult(mel=np.zeros((80, 0)), chunk_latencies_s=[0.2, 0.3, 0.9], chunk_frames=[14, 20, 40], wall_s=1.4)
    count, dry = r.playback_stalls(0.0)
    assert count == 2 and abs(dry - (0.02 + 0.5)) < 1e-9
    assert r.playback_stalls(0.5)[0] == 1 and r.playback_stalls(0.6) == (0, 0.0)
    assert StreamResult(mel=np.zeros((80, 0)), chunk_latencies_s=[0.1, 0.1], chunk_frames=[0, 10],
                        wall_s=0.2).playback_stalls() == (0, 0.0), "an empty first response starts nothing"


def test_a_replay_sends_each_answered_chunk_with_the_steps_its_answer_said():
    """Chunk 0 was solved at 6 steps, chunk 1 at 10, chunk 2 never answered: a replay (a new attempt from the
    first chunk) sends chunk 0 with chunk_steps 6 and chunk 1 with 10, chunk 2 without (the server chooses); an
    answer that said nothing (an older server) leaves the server to choose too. A chunk's steps are kept once, at
    its first answer."""
    s = UtteranceState(0, demo_utterance(1.0, seed=1), [5, 10, 10], tolerance=1e-3)
    s.keep_steps(np.array([[6]], np.int32), 0)
    s.keep_steps(np.array([[10]], np.int32), 1)
    s.keep_steps(np.array([[3]], np.int32), 0)   # a replayed chunk's answer again: already kept
    s.answered = 2
    s.start_attempt(from_snapshot=False)
    sent = []
    for i in range(3):
        s.next_chunk = i
        sent.append(s.tensors().get("chunk_steps"))
    assert [None if t is None else int(t[0, 0]) for t in sent] == [6, 10, None]
    s.next_chunk = 0
    assert "prompt_mel" in s.tensors(), "the replayed START carries the prompt too"
    old = UtteranceState(1, demo_utterance(1.0, seed=1), [5, 20], tolerance=1e-3)
    old.keep_steps(None, 0)
    old.start_attempt(from_snapshot=False)
    assert "chunk_steps" not in old.tensors()
