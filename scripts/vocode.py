#!/usr/bin/env python3
"""Vocode a mel spectrogram with the checkpoint's HiFT vocoder (``mel2wav.*``), as upstream ``HiFTGenerator.inference``.

Input: an .npz with ``mel`` (1, 80, T) float32 (channels-major, as the flow emits it). Output: an .npz with
``audio`` (1, 480 T) float32 at 24 kHz (and ``f0`` (1, T)); no fade-in (upstream's S3Token2Wav adds that).

``--noise-free`` sets the nine harmonics' random initial phases and the sine generator's additive noise to 0 and
computes the source as upstream's CPU torch does (running phase summed in float64, rounded to float32), so the
audio is a deterministic function of weights and mel: upstream's own ``inference`` run the same way agrees to
about 1e-6 (measured in a scratch harness). Without it the source is this project's seeded one (``--seed``),
the one the served vocoder uses.

Example::

    python -c "import numpy as np; np.savez('mel.npz',
        mel=np.random.default_rng(0).normal(-6, 2, (1, 80, 100)).astype('f4'))"
    python scripts/vocode.py --checkpoint s3gen.safetensors --mel mel.npz --output audio.npz --noise-free
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


from s3flow.model.vocoder import load_vocoder


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="S3Gen checkpoint (or a vocoder file we wrote) holding mel2wav.*")
    p.add_argument("--mel", type=Path, required=True, help=".npz with key 'mel' of shape (1, n_mels, T)")
    p.add_argument("--output", type=Path, required=True, help="output .npz (keys 'audio', 'f0')")
    p.add_argument("--noise-free", action="store_true",
                   help="zero initial phases and noise: deterministic, comparable with upstream")
    p.add_argument("--seed", type=int, default=0, help="source noise seed without --noise-free (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with np.load(args.mel) as f:
            mel = np.asarray(f["mel"])
    except (OSError, KeyError, ValueError) as e:
        print(f"error: cannot read 'mel' from {args.mel}: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        hift = load_vocoder(args.checkpoint)
    except (OSError, ValueError) as e:     # CheckpointMismatch is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_mels = hift.config.in_channels
    if mel.ndim != 3 or mel.shape[0] != 1 or mel.shape[1] != n_mels or mel.shape[2] < 1:
        print(f"error: mel must have shape (1, {n_mels}, T >= 1), got {list(mel.shape)}", file=sys.stderr)
        return 2
    if not np.isfinite(mel).all():
        print(f"error: mel holds {int((~np.isfinite(mel)).sum())} NaN or Inf values", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    audio, f0 = hift.inference(torch.from_numpy(mel.astype(np.float32)), seed=args.seed, noise_free=args.noise_free)
    t2 = time.perf_counter()
    audio = audio.detach().float().numpy()
    f0 = f0.detach().double().numpy()
    hop = hift.config.hop_samples
    args.output.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.output, audio=audio, f0=f0)
    seconds = audio.shape[-1] / hift.config.sampling_rate
    print(f"{args.mel}: {mel.shape[2]} frames -> {audio.shape[-1]} samples ({seconds:.2f} s); load {t1 - t0:.1f} s, "
          f"vocode {t2 - t1:.2f} s (RTF {(t2 - t1) / seconds:.3f}){' noise-free' if args.noise_free else ''}; "
          f"wrote {args.output}")
    ok = audio.shape == (1, hop * mel.shape[2]) and bool(np.isfinite(audio).all()) \
        and float(np.abs(audio).max()) <= hift.config.audio_limit
    if not ok:
        print(f"check failed: audio shape {audio.shape} (expected (1, {hop * mel.shape[2]})), finite and "
              f"within +-{hift.config.audio_limit}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
