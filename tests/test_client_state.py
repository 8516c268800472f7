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
