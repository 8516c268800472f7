"""Training the small model in resumable runs, its data, and the intelligibility instrument (no espeak-ng).

* prompts join several same-voice utterances to reach long lengths; a batch's cond can hold the
  utterance's own preceding frames after the prompt (what a bounded-context chunk conditions on);
* a teacher, student or vocoder run cut in two (state saved, then resumed) ends with exactly the weights of
  one uninterrupted run: every random choice of a step is a function of (seed, step);
* WORLD's pitch track finds a tone's F0 at the mel frames' centres and nothing in silence;
* STOI / ESTOI: a recording scores 1 against itself, white noise near 0.36 / 0; Griffin-Lim of the true mel
  lands between; the log-spectral distance of a recording to itself is 0;
* the shipped front-end turns the shipped held-out mels into exactly the shipped tokens.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny_corpus
from s3flow.model.flow import FlowConfig
from s3flow.model.vocoder import VocoderConfig
from s3flow_training.data import Dataset, prompt_for, tokenize
from s3flow_training.distill import train_student
from s3flow_training.intelligibility import griffin_lim, intelligibility, log_spectral_distance
from s3flow_training.package import Frontend, load_heldout
from s3flow_training.train import TrainSettings, batch_plan, draw_prompt_length, make_batch, train_teacher
from s3flow_training.vocoder_train import (VocoderCorpus, VocoderTrainSettings, pitch_track, source_harmonics,
                                           train_vocoder, vocoder_loss)
from s3flow.model.vocoder import HiFTGenerator

TRAINED = Path(__file__).resolve().parents[1] / "checkpoints" / "trained"


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tiny tensors: one thread is faster


def tiny_dataset(seed: int = 0) -> Dataset:
    return tiny_corpus.tiny_dataset(seed, n=16, heldout=4)


# --------------------------------------------------------------------------------------------- data


def _windows(ds: Dataset, index: int, n: int) -> set:
    """Every length-n window of every join of two other same-voice, same-split utterances (as bytes)."""
    u = ds.utterances[index]
    others = [w for j, w in enumerate(ds.utterances) if j != index and w.voice == u.voice and w.heldout == u.heldout]
    out = set()
    for a in others:
        for b in others:
            if a is b:
                continue
            mel = np.concatenate([a.mel, b.mel], axis=1)
            for s in range(a.n_tokens + b.n_tokens - n + 1):
                out.add(mel[:, 2 * s:2 * (s + n)].tobytes())
    return out


def test_a_long_prompt_joins_other_utterances_of_the_same_voice():
    ds = tiny_dataset()
    longest = max(u.n_tokens for u in ds.utterances)
    rng = np.random.default_rng(0)
    for index in (0, 3, 5):                  # training utterances: 5 others of their voice and split
        n = longest + 2                      # longer than any utterance, shorter than any two (8+ tokens each)
        tokens, mel = prompt_for(ds, index, rng, n, n)
        assert tokens.shape == (n,) and mel.shape == (80, 2 * n)
        assert mel.tobytes() in _windows(ds, index, n)   # a stretch of two joined utterances
    # held-out utterance 13 has one other of its voice in its split: the prompt is as long as that one
    tokens, _ = prompt_for(ds, 13, rng, 100, 100)
    assert tokens.size == ds.utterances[15].n_tokens


def test_prompt_lengths_are_drawn_log_uniformly_within_bounds():
    rng = np.random.default_rng(1)
    draws = np.array([draw_prompt_length(rng, (10, 250)) for _ in range(4000)])
    assert draws.min() >= 10 and draws.max() <= 250
    # log-uniform: as many draws in [10, 50) as in [50, 250]
    below = (draws < 50).mean()
    assert 0.4 < below < 0.6, below


def test_a_batch_conditions_on_the_prompt_then_the_utterance_s_own_past():
    ds = tiny_dataset()
    rng = np.random.default_rng(2)
    b = make_batch(ds, [0, 1, 2, 3], rng, prompt_prob=1.0, prompt_tokens=(3, 3), max_tokens=4,
                   context_prob=1.0, context_tokens=3)
    for k in range(4):
        u = ds.utterances[k]
        cond_frames, n = int(b.prompt_frames[k]), int(b.token_len[k])
        context = cond_frames // 2 - 3                 # tokens of the utterance's own past in the cond
        assert 0 <= context <= 3 and n == 3 + context + 4
        tokens = b.tokens[k, 3:n].numpy()              # own past, then the 4-token window
        starts = [a for a in range(u.n_tokens - len(tokens) + 1) if (u.tokens[a:a + len(tokens)] == tokens).all()]
        assert starts, (tokens, u.tokens)
        assert torch.equal(b.cond[k, :, :cond_frames], b.mel[k, :, :cond_frames])
        assert not b.cond[k, :, cond_frames:].any()


def test_batches_are_a_function_of_seed_and_step():
    ds = tiny_dataset()
    split = ds.split(heldout=False)
    seen = [batch_plan(ds, split, 3, seed=0, step=s) for s in range(8)]
    assert seen == [batch_plan(ds, split, 3, seed=0, step=s) for s in range(8)]
    first_epoch = [i for group in seen[:4] for i in group]       # 12 training utterances, 4 batches of 3
    assert sorted(first_epoch) == sorted(split)
    assert batch_plan(ds, split, 3, seed=1, step=0) != seen[0] or batch_plan(ds, split, 3, 1, 1) != seen[1]


# --------------------------------------------------------------------------------------------- resumable runs


def _tiny_settings(**kw) -> TrainSettings:
    return TrainSettings(batch_size=3, teacher_steps=4, warmup_steps=1, uncond_steps=1, prompt_tokens=(3, 6),
                         max_tokens=6, student_rounds=3, student_batch_size=2, fine_steps=4, log_every=100,
                         save_every=100, **kw)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_teacher_run_cut_in_two_ends_where_one_run_does(tmp_path):
    ds, s = tiny_dataset(), _tiny_settings()
    whole, info = train_teacher(ds, s, log=lambda m: None, config=FlowConfig.small())
    assert info["steps_done"] == 4 and info["finished"]
    state = tmp_path / "teacher.pt"
    half, info = train_teacher(ds, s, log=lambda m: None, config=FlowConfig.small(), state_path=state, max_steps=2)
    assert info["steps_done"] == 2 and not info["finished"] and state.is_file()
    assert not _same_weights(half, whole)
    rest, info = train_teacher(ds, s, log=lambda m: None, config=FlowConfig.small(), state_path=state)
    assert info["steps_this_run"] == 2 and info["finished"]
    assert _same_weights(rest, whole)


def test_a_student_run_cut_in_two_ends_where_one_run_does(tmp_path):
    ds, s = tiny_dataset(), _tiny_settings()
    teacher, _ = train_teacher(ds, s, log=lambda m: None, config=FlowConfig.small())
    whole, _ = train_student(teacher, ds, s, log=lambda m: None)
    state = tmp_path / "student.pt"
    train_student(teacher, ds, s, log=lambda m: None, state_path=state, max_steps=1)
    rest, info = train_student(teacher, ds, s, log=lambda m: None, state_path=state)
    assert info["steps_this_run"] == 2 and info["finished"]
    assert _same_weights(rest, whole)


def _tiny_corpus(seed: int = 0) -> VocoderCorpus:
    rng = np.random.default_rng(seed)
    mels, audio, f0 = [], [], []
    for k in range(3):
        t = int(rng.integers(10, 20))
        mels.append(rng.normal(-5, 1, (80, t)).astype(np.float32))
        audio.append((0.1 * rng.standard_normal(480 * t)).astype(np.float32))
        f0.append(np.where(rng.random(t) < 0.6, rng.uniform(90, 250, t), 0.0).astype(np.float32))
    return VocoderCorpus(mels, audio, f0)


def test_a_vocoder_run_cut_in_two_ends_where_one_run_does(tmp_path):
    corpus = _tiny_corpus()
    s = VocoderTrainSettings(steps=3, batch_size=2, segment_frames=8, warmup_steps=1, true_f0_steps=1, log_every=100)
    whole, info = train_vocoder(corpus, s, config=VocoderConfig.small(), log=lambda m: None)
    assert info["finished"] and all(math.isfinite(v) for v in info["last_losses"].values())
    state = tmp_path / "vocoder.pt"
    train_vocoder(corpus, s, state_path=state, config=VocoderConfig.small(), max_steps=1, log=lambda m: None)
    rest, info = train_vocoder(corpus, s, state_path=state, config=VocoderConfig.small(), log=lambda m: None)
    assert info["steps_this_run"] == 2
    assert _same_weights(rest, whole)


def test_the_vocoder_loss_falls_on_one_batch_and_its_gradient_is_finite():
    corpus = _tiny_corpus(1)
    torch.manual_seed(0)
    hift = HiFTGenerator(VocoderConfig.small())
    s = VocoderTrainSettings()
    mel, audio, f0 = corpus.batch(np.random.default_rng(0), 2, 8)
    harmonics = source_harmonics(f0, hift, [1, 2])
    opt = torch.optim.Adam(hift.parameters(), lr=2e-3)
    losses = []
    for _ in range(8):
        loss, _ = vocoder_loss(hift(mel, harmonics), hift.f0_predictor(mel), audio, f0, s)
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in hift.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


# --------------------------------------------------------------------------------------------- F0 and scores


def test_pitch_track_finds_a_tone_and_silence():
    rate, f0 = 24000, 150.0
    t = np.arange(rate) / rate
    voiced = sum(0.3 / k * np.sin(2 * np.pi * k * f0 * t) for k in range(1, 6))
    audio = np.concatenate([voiced, np.zeros(rate // 2)]).astype(np.float32)
    track = pitch_track(audio, len(audio) // 480)
    assert track.shape == (75,)
    np.testing.assert_allclose(track[5:45], f0, rtol=0.01)
    assert (track[55:] == 0).all()


@pytest.fixture(scope="module")
def heldout():
    return load_heldout(TRAINED / "heldout.npz")


def test_a_recording_is_perfectly_intelligible_against_itself_and_noise_is_not(heldout):
    u = heldout[0]
    same = intelligibility(u.reference, u.reference, audio_rate=16000)
    assert same.stoi > 0.999 and same.estoi > 0.999
    noise = 0.1 * np.random.default_rng(0).standard_normal(len(u.reference)).astype(np.float32)
    bad = intelligibility(u.reference, noise, audio_rate=16000)
    assert bad.stoi < 0.5 and abs(bad.estoi) < 0.1
    assert log_spectral_distance(u.reference, u.reference, audio_rate=16000) == 0.0


def test_griffin_lim_of_the_true_mel_is_intelligible(heldout):
    scores = [intelligibility(u.reference, griffin_lim(u.mel)).estoi for u in heldout[:2]]
    assert min(scores) > 0.5, scores


def test_the_shipped_front_end_tokenizes_the_held_out_mels_as_shipped(heldout):
    frontend = Frontend.load(TRAINED / "frontend.npz")
    for u in heldout[:8]:
        np.testing.assert_array_equal(tokenize(u.mel, frontend.voice_stats[u.voice], frontend.codebook),
                                      u.speech_tokens)
        np.testing.assert_array_equal(frontend.xvectors[u.voice], u.xvector)


def test_the_training_record_keeps_a_phase_while_its_own_settings_are_unchanged(tmp_path):
    """scripts/train_small.py's Record: a phase's runs survive a later run whose settings for that phase are
    the same (settings holding tuples included: the file holds lists), and go when they change."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_small", Path(__file__).parents[1] / "scripts" / "train_small.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = {"data_settings": {"n": 1}, "vocoder_settings": {"sizes": (1, 2)}, "train_settings": {"steps": (10, 20)},
            "quick": False}
    path = tmp_path / "training.json"
    rec = mod.Record(path, base)
    rec.add_run("vocoder", {"steps_to": 5, "wall_s": 1.0, "cpu_s": 2.0}, 5, True)
    rec.add_run("teacher", {"steps_to": 7, "wall_s": 1.0, "cpu_s": 2.0}, 7, False)
    again = mod.Record(path, {**base, "train_settings": {"steps": (10, 30)}})
    assert again.phase("vocoder")["finished"] and again.phase("vocoder")["steps_done"] == 5
    assert again.phase("teacher") == {"finished": False, "steps_done": 0, "runs": []}, "its settings changed"


def test_a_longer_vocoder_schedule_keeps_its_record_and_goes_on(tmp_path):
    """--vocoder-steps above the steps done keeps the vocoder's runs and makes it unfinished (it goes on from the
    shipped weights); a shorter schedule, or any other change of its settings, starts it afresh."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_small", Path(__file__).parents[1] / "scripts" / "train_small.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = {"data_settings": {"n": 1}, "vocoder_settings": {"steps": 6, "lr": 1.0}, "train_settings": {}, "quick": False}
    path = tmp_path / "training.json"
    mod.Record(path, base).add_run("vocoder", {"steps_to": 6, "wall_s": 1.0, "cpu_s": 2.0}, 6, True)
    longer = mod.Record(path, {**base, "vocoder_settings": {"steps": 9, "lr": 1.0}}).phase("vocoder")
    assert longer["steps_done"] == 6 and not longer["finished"] and len(longer["runs"]) == 1
    assert mod.Record(path, base).phase("vocoder")["finished"], "the file itself is unchanged until a run"
    shorter = mod.Record(path, {**base, "vocoder_settings": {"steps": 4, "lr": 1.0}}).phase("vocoder")
    other = mod.Record(path, {**base, "vocoder_settings": {"steps": 9, "lr": 2.0}}).phase("vocoder")
    assert shorter["steps_done"] == other["steps_done"] == 0
