"""Training the small model's HiFT vocoder on the corpus' own waveforms (true mel in, 24 kHz audio out).

The network is ``s3flow.model.vocoder.HiFTGenerator`` of upstream's architecture, narrowed
(``trained_vocoder_config``: every rate, kernel, dilation and the source unchanged, the channels cut),
so the file it writes has the ``mel2wav.*`` layout of a real S3Gen checkpoint and loads through the same
code (``load_vocoder``).

Targets, per training utterance of the corpus (``VocoderCorpus``):

* the waveform (``s3flow_training.data.audio_of``) and its true log-mel;
* F0 per mel frame from WORLD's DIO + StoneMask (``pitch_track``, the ``pyworld`` package), read at each
  mel frame's centre, 0 where unvoiced; cached beside the corpus (``<corpus>.f0.npy``).

Losses as HiFT's generator without its discriminators (``vocoder_loss``; with them:
``s3flow_training.vocoder_gan``): L1 between the log-mels of the output and the target (S3Gen's mel,
weight ``mel_weight``), a multi-resolution STFT loss (spectral convergence + L1 of log magnitudes at four
FFT sizes), and L1 of the F0 predictor's output against the tracked F0 (Hz). The decoder's source is the
harmonic excitation of the *tracked* F0 for the first ``true_f0_steps`` steps (so the upsampling stack
learns to use it while the F0 predictor is still wrong), then of the F0 the predictor gives (detached), as
at inference; the source merge is held at a fixed start for the first ``source_frozen_steps``
(``VocoderTrainSettings``: without it the network learns to ignore the source). The shipped weights are
an EMA.

Runs are time-boxed (``budget_s``) and resumable: the whole training state (weights, EMA, optimiser,
step, random generators) goes to ``state_path`` at the end of each run and every ``save_every`` steps.

Example::

    corpus = VocoderCorpus.open("build/small_data/dataset.npz")
    hift, info = train_vocoder(corpus, VocoderTrainSettings(steps=200), state_path="build/vocoder.state")
    write_vocoder_checkpoint(hift, "vocoder.safetensors")
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from s3flow.model.vocoder import HiFTGenerator, VocoderConfig
from s3flow.model.vocoder_source import Excitation, harmonic_source
from s3flow_training.data import Dataset, audio_of
from s3flow_training.mel import S3GEN_MEL, log_mel
from s3flow_training.runstate import Clock, Progress, RunState, optimizer_step, rewarm_factor, step_rng, warm_start
from s3flow_training.train import EMA, Log, lr_at

HOP = S3GEN_MEL.hop_size
#: The vocoder's number in the per-step random streams (``runstate.step_rng``).
VOCODER_PHASE = 40


#: How far below Griffin-Lim's ESTOI on the true mel the small trained vocoder may be and still pass the checks
#: at the end of a training run and of the evaluation: its ceiling is below it (0.792 against 0.859 on the 64
#: held-out sentences, results/small_model.md); a broken vocoder is far below (white noise: 0.0)
GRIFFIN_LIM_MARGIN = 0.1


def trained_vocoder_config() -> VocoderConfig:
    """The shipped small vocoder: upstream's HiFT with 64 base channels (512 upstream: stages of 32, 16
    and 8 channels) and a 128-wide F0 predictor."""
    return VocoderConfig(base_channels=64, f0_cond_channels=128)


@dataclass
class VocoderTrainSettings:
    """Vocoder training hyper-parameters (defaults: the shipped checkpoint)."""
    seed: int = 0
    steps: int = 9000               # the whole schedule (the shipped one: 6,000 then 9,000); each run does a slice
    batch_size: int = 8
    segment_frames: int = 32        # 0.64 s of audio per example
    lr: float = 1e-3
    warmup_steps: int = 200
    betas: tuple[float, float] = (0.8, 0.99)
    grad_clip: float = 5.0
    ema_decay: float = 0.999
    mel_weight: float = 1.0
    stft_weight: float = 1.0
    f0_weight: float = 0.02         # per Hz: an F0 error of 50 Hz weighs as a mel error of 1 (log units)
    true_f0_steps: int = 1000
    #: The source merge (``m_source``: harmonics -> one excitation) starts at ``source_init`` per harmonic and
    #: stays there for the first ``source_frozen_steps`` steps. Trained from the start with these losses (no
    #: discriminator), its weights fell to ~1e-3 within the first thousand steps: the untrained upsampling
    #: stack makes the source look like noise, and the network then never learns to use it (its audio did not
    #: change when the source was zeroed, and ESTOI stalled at 0.66 after 3,500 steps).
    source_init: float = 0.3
    source_frozen_steps: int = 2000
    log_every: int = 50
    save_every: int = 500


# ---------------------------------------------------------------------------------------------------
# Targets


def pitch_track(audio: np.ndarray, frames: int, rate: int = S3GEN_MEL.sampling_rate) -> np.ndarray:
    """F0 in Hz at the centre of each of ``frames`` mel frames (0 where unvoiced): WORLD DIO + StoneMask.

    Mel frame k covers samples [480 k - 720, 480 k + 1200) (``mel.log_mel``'s padding), centred on
    480 k + 240: DIO runs on a 10 ms grid (points at 480 j / 2), whose odd points are those centres.
    """
    import pyworld

    x = np.ascontiguousarray(audio, dtype=np.float64)
    f0, times = pyworld.dio(x, rate, frame_period=10.0, f0_floor=50.0, f0_ceil=500.0)
    f0 = pyworld.stonemask(x, f0, times, rate)
    out = np.zeros(frames, np.float32)
    centres = f0[1::2][:frames]
    out[:len(centres)] = centres
    return out


@dataclass
class VocoderCorpus:
    """The corpus' training (or held-out) utterances as (mel (80, T), audio (480 T,), F0 (T,)) triples."""
    mels: list[np.ndarray]
    audio: list[np.ndarray]
    f0: list[np.ndarray]

    @classmethod
    def open(cls, corpus: str | Path, heldout: bool = False, log: Log = print) -> "VocoderCorpus":
        """Read the corpus, its waveforms and its F0 (tracked once, then cached as ``<corpus>.f0.npy``)."""
        ds = Dataset.load(corpus)
        order = ds.split(heldout=heldout)
        cache = Path(f"{corpus}.f0.npy")
        frames = [2 * u.n_tokens for u in ds.utterances]
        if cache.is_file() and np.load(cache, mmap_mode="r").shape[0] == sum(frames):
            all_f0 = np.load(cache)
        else:
            t0 = time.perf_counter()
            all_f0 = np.concatenate([pitch_track(audio_of(corpus, ds, i), frames[i]) for i in range(len(frames))])
            np.save(cache, all_f0)
            log(f"tracked F0 of {len(frames)} utterances in {time.perf_counter() - t0:.0f} s -> {cache}")
        ends = np.cumsum(frames)
        f0 = [all_f0[ends[i] - frames[i]:ends[i]] for i in order]
        return cls([ds.utterances[i].mel for i in order], [audio_of(corpus, ds, i) for i in order], f0)

    def batch(self, rng: np.random.Generator, size: int, frames: int) -> tuple[torch.Tensor, ...]:
        """Random segments: mel (B, 80, frames), audio (B, 480 frames), F0 (B, frames) Hz."""
        mels, audio, f0 = [], [], []
        for _ in range(size):
            k = int(rng.integers(len(self.mels)))
            n = self.mels[k].shape[1]
            a = int(rng.integers(0, max(1, n - frames + 1)))
            m, y, p = self.mels[k][:, a:a + frames], self.audio[k][HOP * a:HOP * (a + frames)], self.f0[k][a:a + frames]
            if m.shape[1] < frames:   # an utterance shorter than a segment: pad with its silence
                pad = frames - m.shape[1]
                m = np.pad(m, ((0, 0), (0, pad)), mode="edge")
                y, p = np.pad(y, (0, HOP * pad)), np.pad(p, (0, pad))
            mels.append(m)
            audio.append(y)
            f0.append(p)
        return (torch.from_numpy(np.stack(mels)).float(), torch.from_numpy(np.stack(audio)).float(),
                torch.from_numpy(np.stack(f0)).float())


def source_harmonics(f0: torch.Tensor, hift: HiFTGenerator, seeds: Sequence[int]) -> torch.Tensor:
    """(B, H + 1, 480 T) excitation of each row's F0 (B, T), from the utterance start (phase 0), with the
    row's own seeded noise: what ``harmonic_source`` makes at inference."""
    params = hift.source_params
    rows = [harmonic_source(f.detach().double().numpy(), 0, np.zeros(params.rows), Excitation(int(s), params))[0]
            for f, s in zip(f0, seeds)]
    return torch.from_numpy(np.stack(rows))


@dataclass
class VocodedBatch:
    """One training step's segments and what the vocoder made of them."""
    audio: torch.Tensor          # (B, 480 T) the vocoder's output
    f0_pred: torch.Tensor        # (B, T) Hz, the F0 predictor's output
    target_audio: torch.Tensor   # (B, 480 T) the recording
    target_f0: torch.Tensor      # (B, T) Hz, WORLD's track


def vocode_batch(hift: HiFTGenerator, corpus: VocoderCorpus, rng: np.random.Generator, size: int, frames: int,
                 drive_true_f0: bool) -> VocodedBatch:
    """Draw a batch from ``rng`` (segments, then the source's noise seeds) and run the vocoder on it, its
    source driven by the tracked F0 (``drive_true_f0``) or by the predictor's (detached, as at inference)."""
    mel, audio, f0 = corpus.batch(rng, size, frames)
    f0_pred = hift.f0_predictor(mel)
    drive = f0 if drive_true_f0 else f0_pred.detach()
    seeds = rng.integers(0, 2 ** 62, size)
    return VocodedBatch(hift(mel, source_harmonics(drive, hift, seeds)), f0_pred, audio, f0)


# ---------------------------------------------------------------------------------------------------
# Losses

#: (n_fft, hop) of the multi-resolution STFT loss.
STFT_RESOLUTIONS: tuple[tuple[int, int], ...] = ((2048, 512), (1024, 256), (512, 128), (256, 64))


def stft_loss(pred: torch.Tensor, target: torch.Tensor,
              resolutions: Sequence[tuple[int, int]] = STFT_RESOLUTIONS) -> torch.Tensor:
    """Mean over resolutions of spectral convergence + L1 of log magnitudes. pred, target: (B, S)."""
    def magnitude(x: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
        spec = torch.stft(x, n_fft, hop, window=torch.hann_window(n_fft), return_complex=True)
        return torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-10)   # |.| has no gradient at 0

    total = pred.new_zeros(())
    for n_fft, hop in resolutions:
        p, t = magnitude(pred, n_fft, hop), magnitude(target, n_fft, hop)
        total = total + torch.linalg.norm(t - p) / torch.linalg.norm(t) + (t.log() - p.log()).abs().mean()
    return total / len(resolutions)


class LossWeights(Protocol):
    """The weights ``vocoder_loss`` reads (``VocoderTrainSettings``, ``vocoder_gan.VocoderGanSettings``)."""
    mel_weight: float
    stft_weight: float
    f0_weight: float


def vocoder_loss(audio: torch.Tensor, f0_pred: torch.Tensor, target_audio: torch.Tensor, target_f0: torch.Tensor,
                 s: LossWeights) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted sum of the mel, STFT and F0 terms, and each term's value. The mel term compares the
    segment's own log-mels (the input mel was taken over the whole utterance, so its edge frames saw
    samples outside the segment)."""
    mel = F.l1_loss(log_mel(audio), log_mel(target_audio))
    spec = stft_loss(audio, target_audio)
    f0 = F.l1_loss(f0_pred, target_f0)
    loss = s.mel_weight * mel + s.stft_weight * spec + s.f0_weight * f0
    return loss, {"mel": mel.item(), "stft": spec.item(), "f0_hz": f0.item()}


# ---------------------------------------------------------------------------------------------------
# Training


def train_vocoder(corpus: VocoderCorpus, settings: VocoderTrainSettings = VocoderTrainSettings(),
                  state_path: Optional[Path] = None, budget_s: Optional[float] = None,
                  config: Optional[VocoderConfig] = None, start: Optional[HiFTGenerator] = None,
                  start_step: int = 0, max_steps: Optional[int] = None,
                  log: Log = print) -> tuple[HiFTGenerator, dict]:
    """Train (or go on training, from ``state_path``) until ``settings.steps`` or ``budget_s`` seconds.

    ``start``/``start_step``: with no state to resume, begin from these weights at that step of the
    schedule (a committed checkpoint: ``runstate.warm_start``). Returns the EMA weights as a
    HiFTGenerator (eval mode) and a record of the run: steps done in all and in this run, the mean of
    each loss term over the run's last ``log_every`` steps, wall seconds.
    """
    s = settings
    torch.manual_seed(s.seed)
    hift = HiFTGenerator(config or trained_vocoder_config())
    with torch.no_grad():
        hift.m_source.l_linear.weight.fill_(s.source_init)
        hift.m_source.l_linear.bias.zero_()
    opt = torch.optim.AdamW(hift.parameters(), lr=s.lr, betas=s.betas, weight_decay=0.0)
    ema = EMA(hift, s.ema_decay)
    state = RunState(state_path, hift, opt, ema, tag=f"vocoder {hift.config.to_dict()}")
    step, rewarm = state.load(), None
    if step:
        log(f"vocoder: resumed at step {step} from {state_path}")
    elif start is not None:
        warm_start(hift, start.state_dict(), ema)
        step = rewarm = start_step
        log(f"vocoder: warm start at step {step} from the given weights (fresh optimiser)")
    clock = Clock(budget_s, step, max_steps)
    progress = Progress(state, "vocoder step", s.steps, s.log_every, s.save_every, clock, log)
    hift.train()
    source = list(hift.m_source.parameters())
    while step < s.steps and clock.running(step):
        for q in source:   # held at its start for the first steps (VocoderTrainSettings.source_frozen_steps)
            q.requires_grad_(step >= s.source_frozen_steps)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, s.steps, s.lr, s.warmup_steps) * rewarm_factor(step, rewarm)
        made = vocode_batch(hift, corpus, step_rng(s.seed, VOCODER_PHASE, step), s.batch_size, s.segment_frames,
                            drive_true_f0=step < s.true_f0_steps)
        loss, terms = vocoder_loss(made.audio, made.f0_pred, made.target_audio, made.target_f0, s)
        optimizer_step(opt, loss, hift.parameters(), s.grad_clip)
        ema.update(hift, step)
        step += 1
        progress.after(step, terms)
    info = progress.end(step)
    ema.copy_to(hift)
    return hift.eval(), info
