#!/usr/bin/env python3
"""Offline token-to-mel synthesis from explicit inputs, for comparing implementations bit for bit in the noise.

Example::

    .venv/bin/python scripts/flow_infer.py --checkpoint s3gen.safetensors --inputs in.npz --output out.npz

IN.npz holds:
    speech_tokens  (B, N) int64
    prompt_tokens  (1, Np) int64
    prompt_feat    (1, Tp, 80) float32, frames-major, Tp = 2 Np
    embedding      (1, 192) float32 speaker x-vector
    z              (B, 80, T) float32: the whole initial noise, prompt region included,
                   T = 2 (Np + N), minus 6 when not finalised
    n_timesteps    scalar int
    finalize       scalar bool
    cfg_rate       scalar float, optional (default 0.7; ignored by meanflow checkpoints)
Meanflow follows from the checkpoint. OUT.npz holds ``mel`` (B, 80, T - Tp) float32.

``--make-example IN.npz`` writes such an input file (seeded random tokens, prompt and noise) to start from.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch


from s3flow.model.checkpoint import load_flow
from s3flow_contract.tensors import LOOKAHEAD_FRAMES, TOKEN_MEL_RATIO
from s3flow.model.flow import synthesize

REQUIRED = ("speech_tokens", "prompt_tokens", "prompt_feat", "embedding", "z", "n_timesteps", "finalize")


def make_example(path: Path, n_feats: int = 80, batch: int = 1, tokens: int = 50, prompt: int = 25,
                 finalize: bool = True, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    t = TOKEN_MEL_RATIO * (prompt + tokens) - (0 if finalize else LOOKAHEAD_FRAMES)
    np.savez(path, speech_tokens=rng.integers(0, 6561, (batch, tokens), dtype=np.int64),
             prompt_tokens=rng.integers(0, 6561, (1, prompt), dtype=np.int64),
             prompt_feat=(-3 + 1.5 * rng.standard_normal((1, 2 * prompt, n_feats))).astype(np.float32),
             embedding=rng.standard_normal((1, 192)).astype(np.float32),
             z=rng.standard_normal((batch, n_feats, t)).astype(np.float32),
             n_timesteps=np.int64(10), finalize=np.bool_(finalize))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="S3Gen checkpoint (.safetensors or .pt)")
    p.add_argument("--inputs", type=Path, help="IN.npz (see above)")
    p.add_argument("--output", type=Path, help="OUT.npz")
    p.add_argument("--make-example", type=Path, metavar="IN.npz", help="write an example input file and exit")
    p.add_argument("--n-feats", type=int, default=80, help="with --make-example (default: 80)")
    args = p.parse_args(argv)
    if args.make_example:
        make_example(args.make_example, n_feats=args.n_feats)
        print(f"wrote {args.make_example}")
        return 0
    if not (args.checkpoint and args.inputs and args.output):
        p.error("--checkpoint, --inputs and --output are required")

    d = np.load(args.inputs)
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        print(f"error: {args.inputs} lacks {missing}", file=sys.stderr)
        return 2
    flow = load_flow(args.checkpoint)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    try:
        out = synthesize(flow, torch.from_numpy(d["speech_tokens"]).long(),
                         torch.from_numpy(d["prompt_tokens"]).long(),
                         torch.from_numpy(d["prompt_feat"]).float(), torch.from_numpy(d["embedding"]).float(),
                         finalize=bool(d["finalize"]), z=torch.from_numpy(d["z"]).float(),
                         n_steps=int(d["n_timesteps"]),
                         guidance_rate=float(d["cfg_rate"]) if "cfg_rate" in d else 0.7)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    mel = out.mel.numpy().astype(np.float32)
    if not np.isfinite(mel).all():
        print("error: the output holds NaN or Inf", file=sys.stderr)
        return 1
    np.savez(args.output, mel=mel)
    print(f"mel {tuple(mel.shape)} ({'meanflow' if flow.config.meanflow else 'guided'}, {out.nfe} estimator "
          f"calls, {time.perf_counter() - t0:.2f} s) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
