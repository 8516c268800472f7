#!/usr/bin/env python3
"""The main job: build the model repository, start tritonserver, stream one utterance, write outputs, stop.

Examples::

    .venv/bin/python scripts/demo.py                      # full size, seeded random weights, ~5 s utterance
    .venv/bin/python scripts/demo.py --size small         # seconds instead of minutes
    .venv/bin/python scripts/demo.py --checkpoint s3gen.safetensors --inputs utt.npz

Writes ``out/mel_0.npy`` (80 x frames), ``out/mel_0.png``, ``out/audio_0.wav`` (24 kHz, written as it streams)
and ``out/audio_0.png`` (waveform over spectrogram), and prints first-chunk latency, per-chunk
latency and the real-time factor. The server listens on 127.0.0.1 only and is stopped (by PID) at the end.
Exits non-zero if any step fails.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="S3Gen checkpoint; default: seeded random weights")
    p.add_argument("--size", choices=["full", "small"], default="full", help="random weights (default: full)")
    p.add_argument("--meanflow", action="store_true", help="random weights: meanflow (2 steps, no guidance)")
    p.add_argument("--seconds", type=float, default=5.0, help="utterance length (default: 5)")
    p.add_argument("--inputs", type=Path, help=".npz with real tokens (see python -m s3flow_client --help)")
    p.add_argument("--repository", type=Path, default=ROOT / "model_repository", help="(default: %(default)s)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "out", help="(default: %(default)s)")
    p.add_argument("--reuse", action="store_true", help="serve the existing repository as it is")
    p.add_argument("--no-audio", action="store_true", help="mel only: no vocoder, token2mel instead of token2wav")
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "scripts"))
    import build_repository
    from s3flow.triton_server import TritonServer
    from s3flow_client.__main__ import main as client_main

    t0 = time.perf_counter()
    if not args.reuse:
        build = ["--output", str(args.repository), "--size", args.size]
        if args.checkpoint:
            build += ["--checkpoint", str(args.checkpoint)]
        if args.meanflow:
            build.append("--meanflow")
        if args.no_audio:
            build.append("--no-vocoder")
        print(f"== building the model repository ({'checkpoint' if args.checkpoint else args.size + ' random'})")
        if build_repository.main(build) != 0:
            return 1
    print("== starting tritonserver on 127.0.0.1")
    log = args.out_dir / "tritonserver.log"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with TritonServer(args.repository, log_file=log) as server:
        print(f"   ready: gRPC {server.grpc_url}, pid {server.pid}, log {log}")
        print(f"== streaming a {args.seconds:g} s utterance to {'token2mel' if args.no_audio else 'token2wav'}")
        client = ["--url", server.grpc_url, "--out-dir", str(args.out_dir), "--seconds", str(args.seconds),
                  "--model", "token2mel" if args.no_audio else "token2wav"]
        if args.inputs:
            client += ["--inputs", str(args.inputs)]
        code = client_main(client)
        print("== stopping the server")
    print(f"== done in {time.perf_counter() - t0:.0f} s" + ("" if code == 0 else " (with errors)"))
    return code


if __name__ == "__main__":
    sys.exit(main())
