"""The streaming measurements' own pieces: seam roughness, the dry-run cost, joined long utterances."""
import numpy as np

from s3flow_training.package import HeldoutUtterance
from s3flow.engine.planning import planned_calls
from s3flow_training.streaming_eval import long_utterances, seam_roughness
from s3flow_client import chunk_schedule


def test_seam_roughness_is_one_for_a_smooth_signal_and_grows_with_steps_at_seams():
    t = np.arange(200)
    smooth = np.tile(np.sin(t / 7.0), (4, 1))
    assert abs(seam_roughness(smooth, [50, 100, 150]) - 1.0) < 0.2
    jumpy = smooth.copy()
    for s in (50, 100, 150):
        jumpy[:, s:] += 1.0
    assert seam_roughness(jumpy, [50, 100, 150]) > 5
    assert np.isnan(seam_roughness(smooth, []))


def test_planned_calls_prefix_cost_grows_and_bounded_cost_stays_flat():
    chunks = chunk_schedule(1500, 10, 2.0, 100)
    prefix = planned_calls(8, 50, chunks, -1, steps=2)
    bounded = planned_calls(8, 50, chunks, 100, steps=2)
    assert len(prefix) == len(bounded) == 2 * len(chunks)
    assert all(b == 2 for b, _ in prefix + bounded)            # guided: one 2B call per step
    assert prefix[-1][1] == 2 * (50 + 1500)                    # the last chunk re-solves everything
    assert max(t for _, t in bounded) <= 100 + 101 + 200 + 6   # prompt + context + chunk + lookahead


def test_long_utterances_join_one_voices_sentences_with_their_ground_truth():
    rng = np.random.default_rng(0)
    utts = [HeldoutUtterance(rng.integers(0, 512, 40 + 10 * k), rng.integers(0, 512, 20), rng.standard_normal((80, 40)),
                             np.ones(192, np.float32), rng.standard_normal((80, 2 * (40 + 10 * k))), voice=k % 2)
            for k in range(6)]
    [u10, u30] = long_utterances(utts, [10.0, 30.0])
    assert len(u10.speech_tokens) == 250 and u10.mel.shape == (80, 500)
    assert len(u30.speech_tokens) == 750 and u30.mel.shape == (80, 1500)
    src = [x for x in utts if x.voice == u10.voice]
    np.testing.assert_array_equal(u10.speech_tokens[:len(src[1].speech_tokens)], src[1].speech_tokens)
    np.testing.assert_array_equal(u10.prompt_tokens, src[0].speech_tokens[:50][:len(u10.prompt_tokens)])
