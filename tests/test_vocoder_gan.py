"""The small vocoder's adversarial training (``s3flow_training.discriminators``, ``s3flow_training.vocoder_gan``).

* the shipped discriminator setting: eight sub-discriminators whose score maps have the sizes the strides
  give, at most 1.5 M parameters;
* the losses against closed forms (LSGAN, TPR), feature matching zero for identical audio only, the
  discriminators' loss falling on one fixed real-vs-fake batch, the generator's gradient finite;
* a run cut in two (state saved, then resumed), before or after the discriminator-only warm-up ends, ends
  with exactly the state of one run: generator, EMA, discriminators, both optimisers, the logged losses;
* the state file round-trips the discriminators, their optimiser and the running numbers, and refuses a
  state without them;
* ``scripts/train_small.py``'s candidate folder: the shipped files with the new vocoder in place of the old.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from s3flow.model.vocoder import HiFTGenerator, VocoderConfig, load_vocoder
from s3flow_training.discriminators import (DiscriminatorConfig, Discriminators, Judgement, discriminator_loss,
                                            feature_matching_loss, generator_adversarial_loss, parameter_count,
                                            scores, tpr_loss)
from s3flow_training.runstate import RunState
from s3flow_training.train import EMA
from s3flow_training.vocoder_gan import VocoderGanSettings, judged_windows, train_vocoder_gan
from s3flow_training.vocoder_train import VocoderCorpus, vocode_batch, vocoder_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tiny tensors: one thread is faster

#: A tiny discriminator setting (both families, two of each) for the fast tests.
TINY = DiscriminatorConfig(periods=(2, 3), period_channels=(4, 8, 8), resolutions=((256, 64, 128), (128, 32, 64)),
                           spec_channels=4)


def _corpus(seed: int = 0) -> VocoderCorpus:
    rng = np.random.default_rng(seed)
    mels, audio, f0 = [], [], []
    for _ in range(3):
        t = int(rng.integers(10, 20))
        mels.append(rng.normal(-5, 1, (80, t)).astype(np.float32))
        audio.append((0.1 * rng.standard_normal(480 * t)).astype(np.float32))
        f0.append(np.where(rng.random(t) < 0.6, rng.uniform(90, 250, t), 0.0).astype(np.float32))
    return VocoderCorpus(mels, audio, f0)


def _start() -> HiFTGenerator:
    torch.manual_seed(3)
    return HiFTGenerator(VocoderConfig.small())


def _settings(**kw) -> VocoderGanSettings:
    base = dict(steps=4, batch_size=2, segment_frames=8, judge_frames=4, disc_warmup_steps=2,
                generator_warmup_steps=1, discriminator=TINY, log_every=2, save_every=100)
    return VocoderGanSettings(**{**base, **kw})


# --------------------------------------------------------------------------------------------- discriminators


def test_the_shipped_discriminators_have_the_strides_score_sizes_and_at_most_1_5_m_parameters():
    config = DiscriminatorConfig()
    judges = Discriminators(config)
    total = parameter_count(judges)
    assert 0.5e6 < total <= 1.5e6, total
    samples = 480 * 16
    out = judges(0.1 * torch.randn(2, samples))
    assert len(out) == len(config.periods) + len(config.resolutions) == 8
    for p, j in zip(config.periods, out[:5]):
        rows = -(-samples // p)
        for _ in range(4):               # four stride-3 layers (kernel 5, padding 2): ceil(rows / 3)
            rows = -(-rows // 3)
        assert j.score.shape == (2, rows * p), p
        assert len(j.features) == 6 and j.features[-1].shape == (2, 1, rows, p)
    for (n_fft, hop, _), j in zip(config.resolutions, out[5:]):
        frames, bins = samples // hop + 1, n_fft // 2 + 1
        for _ in range(3):               # three frequency strides of 2 (kernel 9, padding 4)
            bins = (bins - 1) // 2 + 1
        assert j.score.shape == (2, frames * bins), n_fft
        assert len(j.features) == 6


def test_a_period_discriminator_takes_audio_of_any_length():
    judges = Discriminators(TINY)
    for samples in (1001, 1002, 1003):
        assert all(torch.isfinite(j.score).all() for j in judges(torch.randn(1, samples)))


# --------------------------------------------------------------------------------------------- losses


def _judged(*score_rows) -> list[Judgement]:
    return [Judgement(torch.tensor([row], dtype=torch.float32), []) for row in score_rows]


def test_the_lsgan_losses_against_their_closed_forms():
    real, fake = _judged([1.0, 1.0], [0.5, 1.5]), _judged([0.0, 0.0], [0.5, -0.5])
    # D: sum over the two sub-discriminators of mean (1 - r)^2 + mean f^2
    assert discriminator_loss(real, fake).item() == pytest.approx(0 + 0 + 0.25 + 0.25)
    # G: sum of mean (1 - f)^2
    assert generator_adversarial_loss(fake).item() == pytest.approx(1.0 + (0.25 + 2.25) / 2)


def test_tpr_loss_is_the_capped_spread_of_the_gaps_below_their_median():
    upper, lower = [torch.tensor([[0.0, 1.0, 2.0, 3.0]])], [torch.zeros(1, 4)]
    # gaps 0 1 2 3, median 1 (torch's lower median): below it only 0, (0 - 1)^2 = 1
    assert tpr_loss(upper, lower, tau=10.0).item() == pytest.approx(1.0)
    assert tpr_loss(upper, lower, tau=0.04).item() == pytest.approx(0.04)
    assert tpr_loss([torch.ones(1, 4)], [torch.zeros(1, 4)]).item() == 0.0, "no gap below the median"


def test_feature_matching_is_zero_for_identical_audio_only():
    torch.manual_seed(0)
    judges = Discriminators(TINY)
    audio = 0.1 * torch.randn(2, 2000)
    assert feature_matching_loss(judges(audio), judges(audio.clone())).item() == 0.0
    assert feature_matching_loss(judges(audio), judges(audio + 0.01 * torch.randn(2, 2000))).item() > 0


def test_the_discriminator_loss_falls_on_one_fixed_real_vs_fake_batch():
    torch.manual_seed(0)
    judges = Discriminators(TINY)
    t = torch.arange(3000) / 24000
    real = torch.stack([0.3 * torch.sin(2 * math.pi * f * t) for f in (150.0, 220.0)])
    fake = 0.1 * torch.randn(2, 3000)
    opt = torch.optim.Adam(judges.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss = discriminator_loss(judges(real), judges(fake))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_the_generator_s_adversarial_gradient_is_finite_and_reaches_every_layer():
    corpus, hift = _corpus(), _start()
    judges = Discriminators(TINY).requires_grad_(False)
    rng = np.random.default_rng(0)
    made = vocode_batch(hift, corpus, rng, 2, 8, drive_true_f0=False)
    real_window, fake_window = judged_windows(rng, made.target_audio, made.audio, 4)
    real, fake = judges(real_window), judges(fake_window)
    recon, _ = vocoder_loss(made.audio, made.f0_pred, made.target_audio, made.target_f0, VocoderGanSettings())
    loss = (recon + generator_adversarial_loss(fake) + 2 * feature_matching_loss(real, fake)
            + tpr_loss(scores(fake), scores(real)))
    loss.backward()
    grads = {name: q.grad for name, q in hift.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["conv_post.parametrizations.weight.original1"].abs().sum() > 0
    assert all(q.grad is None for q in judges.parameters()), "the generator's step leaves the judges alone"


def test_the_judged_windows_are_the_same_stretch_of_real_and_fake():
    real = torch.arange(2 * 4800, dtype=torch.float32).reshape(2, 4800)
    a, b = judged_windows(np.random.default_rng(1), real, real + 0.5, 4)
    assert a.shape == b.shape == (2, 1920)
    assert torch.equal(b - a, torch.full_like(a, 0.5))
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(2, 1919)), "one contiguous window per row"
    assert a[0, 0] != a[1, 0] - 4800, "the rows' windows are drawn apart"
    whole, _ = judged_windows(np.random.default_rng(1), real, real, 10)
    assert torch.equal(whole, real)


# --------------------------------------------------------------------------------------------- runs and state


def _state_equal(a: dict, b: dict, path: str = "") -> None:
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _state_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _state_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("cut", [1, 3], ids=["in-the-warm-up", "after-it"])
def test_a_run_cut_in_two_ends_where_one_run_does(tmp_path, cut):
    corpus, s = _corpus(), _settings()
    whole, info = train_vocoder_gan(corpus, s, start=_start(), state_path=tmp_path / "whole.pt", log=lambda m: None)
    assert info["finished"] and info["steps_this_run"] == 4
    assert {"mel", "d", "adv", "fm"} <= set(info["last_losses"])
    assert all(math.isfinite(v) for v in info["last_losses"].values())
    assert not torch.equal(whole.conv_post.parametrizations.weight.original1,
                           _start().conv_post.parametrizations.weight.original1), "the generator moved"
    state = tmp_path / "cut.pt"
    _, half = train_vocoder_gan(corpus, s, start=_start(), state_path=state, max_steps=cut, log=lambda m: None)
    assert half["steps_done"] == cut and not half["finished"]
    rest, again = train_vocoder_gan(corpus, s, start=_start(), state_path=state, log=lambda m: None)
    assert again["steps_this_run"] == 4 - cut and again["finished"]
    assert again["last_losses"] == info["last_losses"]
    for k, v in whole.state_dict().items():
        assert torch.equal(v, rest.state_dict()[k]), k
    _state_equal(torch.load(tmp_path / "whole.pt", weights_only=False), torch.load(state, weights_only=False))


def test_a_run_needs_a_generator_to_start_from():
    with pytest.raises(ValueError, match="trained generator"):
        train_vocoder_gan(_corpus(), _settings(), start=None, log=lambda m: None)


def test_hold_source_keeps_the_source_merge_and_only_it():
    corpus = _corpus()
    start = _start()
    held, _ = train_vocoder_gan(corpus, _settings(hold_source=True), start=start, log=lambda m: None)
    free, _ = train_vocoder_gan(corpus, _settings(), start=start, log=lambda m: None)
    w0 = start.m_source.l_linear.weight
    assert torch.equal(held.m_source.l_linear.weight, w0)
    assert not torch.equal(free.m_source.l_linear.weight, w0)
    assert not torch.equal(held.conv_pre.parametrizations.weight.original1,
                           start.conv_pre.parametrizations.weight.original1)


def test_the_state_file_round_trips_the_discriminators_their_optimiser_and_the_running_numbers(tmp_path):
    def parts(seed: int):
        torch.manual_seed(seed)
        model, judges = torch.nn.Linear(3, 2), Discriminators(TINY)
        opt, opt_d = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(judges.parameters(), lr=1e-3)
        return model, judges, opt, opt_d, EMA(model, 0.9)

    model, judges, opt, opt_d, ema = parts(0)
    loss = discriminator_loss(judges(torch.randn(1, 2000)), judges(torch.randn(1, 2000)))
    loss.backward()
    opt_d.step()
    path = tmp_path / "state.pt"
    RunState(path, model, opt, ema, tag="t", extra={"judges": judges, "opt_d": opt_d}).save(
        7, running={"recent": [{"d": 1.5}], "last": {"d": 2.0}})
    model2, judges2, opt2, opt_d2, ema2 = parts(1)
    assert not torch.equal(judges2.mpd.discriminators[0].conv_post.parametrizations.weight.original1,
                           judges.mpd.discriminators[0].conv_post.parametrizations.weight.original1)
    back = RunState(path, model2, opt2, ema2, tag="t", extra={"judges": judges2, "opt_d": opt_d2})
    assert back.load() == 7
    assert back.running == {"recent": [{"d": 1.5}], "last": {"d": 2.0}}
    _state_equal(judges.state_dict(), judges2.state_dict())
    _state_equal(opt_d.state_dict(), opt_d2.state_dict())
    assert len(opt_d2.state_dict()["state"]) == len(list(judges.parameters())), "Adam's moments came back"
    with pytest.raises(ValueError, match="no state of"):
        RunState(path, model2, opt2, ema2, tag="t", extra={"judges": judges2, "other": opt_d2}).load()


# --------------------------------------------------------------------------------------------- train_small.py


def _train_small():
    path = Path(__file__).parents[1] / "scripts" / "train_small.py"
    spec = importlib.util.spec_from_file_location("train_small", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_candidate_folder_is_the_shipped_files_with_the_new_vocoder(tmp_path):
    mod = _train_small()
    shipped, candidate = tmp_path / "shipped", tmp_path / "candidate"
    (shipped / "state").mkdir(parents=True)
    (shipped / "teacher.safetensors").write_bytes(b"teacher")
    (shipped / "heldout.npz").write_bytes(b"heldout")
    (shipped / "state" / "vocoder_gan.pt").write_bytes(b"state")
    old, new = _start(), HiFTGenerator(VocoderConfig.small())
    mod.write_vocoder_checkpoint(old, shipped / "vocoder.safetensors")
    mod.write_candidate(shipped, candidate, new)
    assert sorted(p.name for p in candidate.iterdir()) == ["heldout.npz", "teacher.safetensors", "vocoder.safetensors"]
    assert (candidate / "teacher.safetensors").read_bytes() == b"teacher"
    loaded = load_vocoder(candidate / "vocoder.safetensors")
    assert torch.equal(loaded.conv_pre.parametrizations.weight.original1,
                       new.conv_pre.parametrizations.weight.original1)
    assert torch.equal(load_vocoder(shipped / "vocoder.safetensors").conv_pre.parametrizations.weight.original1,
                       old.conv_pre.parametrizations.weight.original1), "the shipped vocoder is untouched"
    with pytest.raises(ValueError, match="itself"):
        mod.write_candidate(shipped, shipped, new)


def test_the_adversarial_phase_keeps_its_record_while_its_settings_stay(tmp_path):
    mod = _train_small()
    base = {"data_settings": {"n": 1}, "vocoder_settings": {"steps": 6}, "train_settings": {},
            "vocoder_gan_settings": {"steps": 10, "mel_weight": 45.0}, "quick": False}
    path = tmp_path / "training.json"
    mod.Record(path, base).add_run("vocoder_gan", {"steps_to": 10, "wall_s": 1.0, "cpu_s": 2.0}, 10, True)
    assert mod.Record(path, {**base, "vocoder_settings": {"steps": 9}}).phase("vocoder_gan")["steps_done"] == 10
    longer = mod.Record(path, {**base, "vocoder_gan_settings": {"steps": 20, "mel_weight": 45.0}}).phase("vocoder_gan")
    assert longer["steps_done"] == 10 and not longer["finished"]
    other = mod.Record(path, {**base, "vocoder_gan_settings": {"steps": 10, "mel_weight": 1.0}}).phase("vocoder_gan")
    assert other["steps_done"] == 0


def test_a_run_with_the_default_settings_keeps_every_shipped_phase_s_record():
    """main() writes training.json at its end: with settings other than the shipped ones (the vocoder's
    schedule was 6,000 by default against the shipped 9,000), running only vocoder_gan dropped the vocoder's
    record."""
    import argparse
    import dataclasses

    mod = _train_small()
    args = argparse.Namespace(seed=0, quick=False, vocoder_steps=None, vocoder_gan_steps=None)
    data_s, voc_s, flow_s, gan_s = mod.settings_for(args)
    shipped = mod.DEFAULT_OUT / "training.json"
    record = mod.Record(shipped, {"data_settings": dataclasses.asdict(data_s),
                                  "vocoder_settings": dataclasses.asdict(voc_s),
                                  "train_settings": dataclasses.asdict(flow_s),
                                  "vocoder_gan_settings": dataclasses.asdict(gan_s), "quick": False})
    for name in ("vocoder", "teacher", "student"):
        assert record.phase(name)["finished"] and record.phase(name)["runs"], name
