#!/usr/bin/env python3
"""Compute a speaker prompt from a reference wav, as upstream S3Gen's ``embed_ref`` does.

Reads the WAV at its own sample rate (16, 24, 44.1 kHz ... no resampling or cut before the front-end), runs the
checkpoint's S3TokenizerV2 and CAMPPlus and S3Gen's 24 kHz mel (``s3flow.model.voice``), and writes an .npz with

    prompt_tokens  (1, Np)    int64
    prompt_feat    (1, T, 80) float32   T = 2 Np, or 2 Np + 1 when upstream keeps an odd last frame
    embedding      (1, 192)   float32

Bad audio (too short or long, silent, NaN, stereo, ...) is reported and the script exits 2; a failed self-check
exits 1.

Example::

    python scripts/build_repository.py --size small --no-check      # writes a seeded random checkpoint
    python scripts/embed_voice.py --checkpoint checkpoints/s3gen_random_small_seed0.safetensors \\
        --wav ref.wav --output voice.npz
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


from s3flow.model.voice import VoiceFrontend, VoiceLimits
from s3flow_client.audio import read_wav


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="S3Gen checkpoint (.safetensors or .pt) holding tokenizer.* and speaker_encoder.*")
    p.add_argument("--wav", type=Path, required=True, help="reference WAV (PCM 8/16/24/32-bit or float)")
    p.add_argument("--output", type=Path, required=True, help="output .npz")
    p.add_argument("--mix", action="store_true", help="average the channels of a multi-channel file "
                   "(without it a stereo file is refused)")
    p.add_argument("--max-seconds", type=float, default=VoiceLimits().max_seconds,
                   help="longest reference accepted (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        samples, rate = read_wav(args.wav)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if samples.ndim == 2 and args.mix:
        samples = samples.mean(axis=1)
    t0 = time.perf_counter()
    try:
        frontend = VoiceFrontend.from_checkpoint(args.checkpoint, limits=VoiceLimits(max_seconds=args.max_seconds))
    except (OSError, ValueError) as e:     # CheckpointMismatch is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    try:
        prompt = frontend.embed(samples, rate)
    except ValueError as e:
        print(f"error: {args.wav}: {e}", file=sys.stderr)
        return 2
    t2 = time.perf_counter()
    np_, t = prompt.prompt_tokens.shape[1], prompt.prompt_feat.shape[1]
    checks = {
        "prompt_tokens (1, Np) int64": prompt.prompt_tokens.dtype == np.int64 and prompt.prompt_tokens.shape[0] == 1,
        "tokens in [0, 6561)": bool(((prompt.prompt_tokens >= 0) & (prompt.prompt_tokens < 6561)).all()),
        "prompt_feat (1, T, 80) float32": prompt.prompt_feat.shape[::2] == (1, 80)
        and prompt.prompt_feat.dtype == np.float32,
        "T is 2 Np or 2 Np + 1": t in (2 * np_, 2 * np_ + 1),
        "embedding (1, 192) float32": prompt.embedding.shape == (1, 192) and prompt.embedding.dtype == np.float32,
        "all finite": bool(np.isfinite(prompt.prompt_feat).all() and np.isfinite(prompt.embedding).all()),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.output, **prompt.as_dict())
    seconds = samples.shape[0] / rate
    print(f"{args.wav}: {seconds:.2f} s at {rate} Hz -> {np_} prompt tokens, {t} mel frames; "
          f"load {t1 - t0:.1f} s, embed {t2 - t1:.2f} s (RTF {(t2 - t1) / seconds:.3f}); wrote {args.output}")
    if t == 2 * np_ + 1:
        print("note: T = 2 Np + 1 (upstream keeps the odd last frame); a START request takes the first 2 Np "
              "frames (VoicePrompt.aligned())")
    failed = [name for name, ok in checks.items() if not ok]
    for name in failed:
        print(f"check failed: {name}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
