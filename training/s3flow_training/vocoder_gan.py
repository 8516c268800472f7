"""Adversarial training of the small HiFT vocoder (HiFT's / HiFi-GAN's recipe), from its trained weights.

The plain training (``s3flow_training.vocoder_train``) fits the mel, STFT magnitudes and F0 only, so the
phase the vocoder makes is its own; HiFT owes its phase to discriminators. This phase goes on from a
trained generator (the shipped ``vocoder.safetensors``: ``runstate.warm_start``, its EMA weights become
the weights and the EMA) with fresh discriminators (``s3flow_training.discriminators``: the multi-period
and the multi-resolution spectral ones, narrowed), keeping the generator's size and layout, so the result
loads and serves as the shipped one does.

Per step, on one batch of ``batch_size`` segments of ``segment_frames`` mel frames (drawn from
``step_rng(seed, VOCODER_GAN_PHASE, step)``, so a run cut in two is one run):

1. the generator makes the segments' audio (its source driven by its own F0, detached, as at inference);
2. the discriminators judge the same random ``judge_frames``-frame window of each recording and of each
   generated segment (compute: 2 CPU cores) and take one step on the LSGAN loss (+ TPR);
3. after the first ``disc_warmup_steps`` steps (discriminators only, the generator held), the generator
   takes one step on ``mel_weight`` mel L1 + ``stft_weight`` multi-resolution STFT + ``f0_weight`` F0 L1
   (the plain training's terms, ``vocoder_loss``) + ``adversarial_weight`` LSGAN + ``feature_weight``
   feature matching + ``tpr_weight`` TPR, judged by the discriminators just updated; then its EMA.

``VocoderGanSettings`` has the defaults and why. The source merge (``m_source.l_linear``, 9 harmonics -> 1)
once collapsed to ~1e-3 in plain training: its weight norm is on every log line, and ``hold_source``
keeps it fixed.

Runs are time-boxed (``budget_s``) and resumable: generator, EMA, discriminators, both optimisers, the step
and the running loss means go to ``state_path`` every ``save_every`` steps and at the end of each run.

Example::

    corpus = VocoderCorpus.open("build/small_data/dataset.npz")
    hift, info = train_vocoder_gan(corpus, start=load_vocoder("checkpoints/trained/vocoder.safetensors"),
                                   state_path=Path("/tmp/vocoder_gan.pt"), budget_s=600)
    write_vocoder_checkpoint(hift, "build/candidate/vocoder.safetensors")
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from s3flow.model.vocoder import HiFTGenerator
from s3flow_training.discriminators import (DiscriminatorConfig, Discriminators, discriminator_loss,
                                            feature_matching_loss, generator_adversarial_loss, parameter_count,
                                            scores, tpr_loss)
from s3flow_training.runstate import Clock, Progress, RunState, optimizer_step, rewarm_factor, step_rng, warm_start
from s3flow_training.train import EMA, Log
from s3flow_training.vocoder_train import HOP, VocoderCorpus, vocode_batch, vocoder_loss

#: The adversarial phase's number in the per-step random streams (``runstate.step_rng``).
VOCODER_GAN_PHASE = 41


@dataclass
class VocoderGanSettings:
    """Adversarial fine-tuning of the vocoder (defaults: the small vocoder's pilot)."""
    seed: int = 0
    steps: int = 4000               # the whole schedule, warm-up included; each run does a time-boxed slice
    batch_size: int = 8             # as the plain training
    segment_frames: int = 32        # 0.64 s per example for the reconstruction terms, as the plain training
    #: The discriminators judge a random window of this many frames of each segment: 0.32 s, about HiFi-GAN's
    #: 8,192 samples at 22 kHz, and half the discriminators' compute (most of a step's on 2 cores).
    judge_frames: int = 16
    #: Discriminator-only steps first: fresh discriminators judge the trained generator before it hears them.
    disc_warmup_steps: int = 200
    lr_generator: float = 2e-4      # CosyVoice's GAN stage: Adam 2e-4 for both, constant
    lr_discriminator: float = 2e-4
    generator_warmup_steps: int = 50   # the generator's fresh optimiser ramps up after the warm-up
    betas: tuple[float, float] = (0.8, 0.99)   # HiFi-GAN's
    grad_clip: float = 5.0          # CosyVoice's, both networks
    ema_decay: float = 0.999        # as the plain training: the shipped weights are the EMA
    #: Reconstruction terms (``vocoder_loss``). HiFT's generator loss is 45 mel L1 + 1 F0 L1 (Hz) + 1 LSGAN +
    #: 2 feature matching + 1 TPR; the mel and F0 weights are HiFT's, and our multi-resolution STFT term
    #: (not in HiFT) gets a weight that makes it a little lighter than the mel term at the shipped weights'
    #: values (10 x 1.33 against 45 x 0.41), so the adversarial terms are not drowned.
    mel_weight: float = 45.0
    stft_weight: float = 10.0
    f0_weight: float = 1.0
    adversarial_weight: float = 1.0
    feature_weight: float = 2.0     # HiFi-GAN's
    tpr_weight: float = 1.0         # CosyVoice's truncated pointwise relativistic loss (0: off)
    tpr_tau: float = 0.04
    #: Keep the source merge (``m_source``) at the start's weights.
    hold_source: bool = False
    discriminator: DiscriminatorConfig = field(default_factory=DiscriminatorConfig)
    log_every: int = 50
    save_every: int = 200


def judged_windows(rng: np.random.Generator, real: torch.Tensor, fake: torch.Tensor, frames: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same random window of ``frames`` mel frames (480 per frame) of each row of real and fake (B, S);
    the whole rows when they are no longer."""
    length = HOP * frames
    batch, samples = real.shape
    if length >= samples:
        return real, fake
    starts = torch.from_numpy(rng.integers(0, samples - length + 1, batch))
    index = starts[:, None] + torch.arange(length)
    return real.gather(1, index), fake.gather(1, index)


def source_weight_norm(hift: HiFTGenerator) -> float:
    """|w| of the source merge (9 harmonics -> 1): near 0 means the network ignores its source."""
    return float(torch.linalg.vector_norm(hift.m_source.l_linear.weight.detach()))


def train_vocoder_gan(corpus: VocoderCorpus, settings: VocoderGanSettings = VocoderGanSettings(),
                      start: Optional[HiFTGenerator] = None, state_path: Optional[Path] = None,
                      budget_s: Optional[float] = None, max_steps: Optional[int] = None,
                      log: Log = print) -> tuple[HiFTGenerator, dict]:
    """Train (or go on training, from ``state_path``) until ``settings.steps`` or ``budget_s`` seconds.

    ``start``: the trained generator to begin from when there is no state to resume (its config is the
    generator's; needed for the state's config too). Returns the EMA weights as a HiFTGenerator (eval
    mode) and a record of the run: steps done in all and in this run, the mean of each loss term over the
    last ``log_every`` steps, wall seconds, seconds per step, the source merge's weight norm.
    """
    if start is None:
        raise ValueError("an adversarial run starts from a trained generator: pass start")
    s = settings
    torch.manual_seed(s.seed)
    hift = HiFTGenerator(start.config)
    judges = Discriminators(s.discriminator)
    generator_optimizer = torch.optim.AdamW(hift.parameters(), lr=s.lr_generator, betas=s.betas, weight_decay=0.0)
    judges_optimizer = torch.optim.AdamW(judges.parameters(), lr=s.lr_discriminator, betas=s.betas, weight_decay=0.0)
    ema = EMA(hift, s.ema_decay)
    state = RunState(state_path, hift, generator_optimizer, ema,
                     tag=f"vocoder_gan {hift.config.to_dict()} {dataclasses.asdict(s.discriminator)}",
                     extra={"discriminators": judges, "discriminator_optimizer": judges_optimizer})
    step = state.load()
    if step:
        log(f"vocoder_gan: resumed at step {step} from {state_path}")
    else:
        warm_start(hift, start.state_dict(), ema)
        log("vocoder_gan: from the given generator, fresh discriminators "
            f"({parameter_count(judges):,} parameters)")
    clock = Clock(budget_s, step, max_steps)
    progress = Progress(state, "vocoder_gan step", s.steps, s.log_every, s.save_every, clock, log,
                        detail=lambda: f", source |w| {source_weight_norm(hift):.4f}"
                                       + ("" if step > s.disc_warmup_steps else " (discriminators only)"))
    hift.train()
    judges.train()
    for q in hift.m_source.parameters():
        q.requires_grad_(not s.hold_source)
    while step < s.steps and clock.running(step):
        generator_step = step >= s.disc_warmup_steps
        for g in generator_optimizer.param_groups:
            g["lr"] = s.lr_generator * rewarm_factor(step, s.disc_warmup_steps, s.generator_warmup_steps)
        rng = step_rng(s.seed, VOCODER_GAN_PHASE, step)
        with torch.set_grad_enabled(generator_step):
            made = vocode_batch(hift, corpus, rng, s.batch_size, s.segment_frames, drive_true_f0=False)
            reconstruction, terms = vocoder_loss(made.audio, made.f0_pred, made.target_audio, made.target_f0, s)
        real_window, fake_window = judged_windows(rng, made.target_audio, made.audio, s.judge_frames)

        judges.requires_grad_(True)
        real, fake = judges(real_window), judges(fake_window.detach())
        loss_d = discriminator_loss(real, fake)
        tpr_d = tpr_loss(scores(real), scores(fake), s.tpr_tau)
        optimizer_step(judges_optimizer, loss_d + s.tpr_weight * tpr_d, judges.parameters(), s.grad_clip)
        terms.update(d=loss_d.item(), d_tpr=tpr_d.item())

        if generator_step:
            judges.requires_grad_(False)   # the generator's step needs gradients of its input only
            with torch.no_grad():
                real = judges(real_window)
            fake = judges(fake_window)
            adversarial = generator_adversarial_loss(fake)
            features = feature_matching_loss(real, fake)
            tpr_g = tpr_loss(scores(fake), scores(real), s.tpr_tau)
            loss_g = (reconstruction + s.adversarial_weight * adversarial + s.feature_weight * features
                      + s.tpr_weight * tpr_g)
            optimizer_step(generator_optimizer, loss_g, hift.parameters(), s.grad_clip)
            ema.update(hift, step)
            terms.update(adv=adversarial.item(), fm=features.item(), g_tpr=tpr_g.item())
        step += 1
        progress.after(step, terms)
    info = {**progress.end(step), "source_weight_norm": round(source_weight_norm(hift), 5)}
    ema.copy_to(hift)
    return hift.eval(), info
