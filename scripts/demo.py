#!/usr/bin/env python3
"""The main job: build the model repository, start tritonserver, stream one utterance, write outputs, stop.

Examples::

    .venv/bin/python scripts/demo.py                      # the small model trained here, its held-out demo
    .venv/bin/python scripts/demo.py --meanflow           # the same with its 2-step meanflow student
    .venv/bin/python scripts/demo.py --size full          # full size (71 M estimator), seeded random weights
    .venv/bin/python scripts/demo.py --checkpoint s3gen.safetensors --inputs utt.npz
    .venv/bin/python scripts/demo.py --voice              # start by a voice registered from a reference wav

``--size small`` (the default) serves ``checkpoints/trained/teacher.safetensors`` (``student.safetensors``
with ``--meanflow``) and streams ``checkpoints/trained/demo_utt.npz``, a held-out sentence whose ground
truth mel is drawn above the streamed one. ``--size full`` serves seeded random weights of the real
size (for cost measurements: the spectrogram is noise).

Writes ``out/mel_0.npy`` (80 x frames), ``out/mel_0.png``, ``out/audio_0.wav`` (24 kHz, written as it streams)
and ``out/audio_0.png`` (waveform over spectrogram), and prints first-chunk latency, per-chunk
latency and the real-time factor. The small model's audio comes from a vocoder with seeded random
weights (no vocoder is trained here): only the mel is meaningful. The server listens on 127.0.0.1
only and is stopped (by PID) at the end. Exits non-zero if any step fails.

``--voice [WAV]`` registers a reference recording with the ``voice_encoder`` model (default: one made here,
``out/reference.wav``: espeak-ng when installed, else a synthetic voiced signal) and starts the utterance by
its voice id. The trained small model has no front-end of its own, so its repository gets seeded random
front-end weights: the path is real, the prompt it makes is not one the small model was trained on.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "checkpoints" / "trained"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="S3Gen checkpoint; default: seeded random weights")
    p.add_argument("--size", choices=["full", "small"], default="small",
                   help="small: the model trained here; full: seeded random weights (default: small)")
    p.add_argument("--meanflow", action="store_true", help="the meanflow (2-step) model: the trained student, "
                   "or random meanflow weights")
    p.add_argument("--seconds", type=float, default=5.0, help="utterance length (default: 5)")
    p.add_argument("--inputs", type=Path, help=".npz with real tokens (see python -m s3flow_client --help)")
    p.add_argument("--repository", type=Path, default=ROOT / "model_repository", help="(default: %(default)s)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "out", help="(default: %(default)s)")
    p.add_argument("--reuse", action="store_true", help="serve the existing repository as it is")
    p.add_argument("--no-audio", action="store_true", help="mel only: no vocoder, token2mel instead of token2wav")
    p.add_argument("--voice", nargs="?", const="make", metavar="WAV",
                   help="start by a registered voice: this reference wav, or (no value) one this demo makes "
                        "(espeak-ng when installed, else a synthetic voiced signal) at 44.1 kHz")
    args = p.parse_args(argv)
    if args.size == "small" and args.checkpoint is None:
        args.checkpoint = TRAINED / ("student.safetensors" if args.meanflow else "teacher.safetensors")
        if not args.checkpoint.is_file():
            print(f"error: {args.checkpoint} is missing (`make train` makes it)", file=sys.stderr)
            return 1
        args.inputs = args.inputs or TRAINED / "demo_utt.npz"

    sys.path.insert(0, str(ROOT / "scripts"))
    import build_repository
    from s3flow.serving.triton_server import TritonServer
    from s3flow_client.__main__ import main as client_main

    t0 = time.perf_counter()
    if not args.reuse:
        build = ["--output", str(args.repository), "--size", args.size]
        if args.checkpoint:
            build += ["--checkpoint", str(args.checkpoint)]
        if args.meanflow and not args.checkpoint:
            build.append("--meanflow")
        if args.no_audio:
            build.append("--no-vocoder")
        if args.voice and args.checkpoint:  # the trained model has no front-end: seeded random front-end weights
            build += ["--voice-checkpoint", str(random_voice_file(args.repository.resolve().parent / "checkpoints"))]
        print(f"== building the model repository ({args.checkpoint or args.size + ' random weights'})")
        if build_repository.main(build) != 0:
            return 1
    print("== starting tritonserver on 127.0.0.1")
    log = args.out_dir / "tritonserver.log"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with TritonServer(args.repository, log_file=log) as server:
        print(f"   ready: gRPC {server.grpc_url}, pid {server.pid}, log {log}")
        what = args.inputs or f"a {args.seconds:g} s utterance of random tokens"
        print(f"== streaming {what} to {'token2mel' if args.no_audio else 'token2wav'}")
        client = ["--url", server.grpc_url, "--out-dir", str(args.out_dir), "--seconds", str(args.seconds),
                  "--model", "token2mel" if args.no_audio else "token2wav"]
        if args.inputs:
            client += ["--inputs", str(args.inputs)]
        if args.voice:
            wav = Path(args.voice) if args.voice != "make" else make_reference(args.out_dir / "reference.wav")
            print(f"== registering the reference {wav}; the utterance starts by its voice id")
            client += ["--voice", str(wav)]
        code = client_main(client)
        print("== stopping the server")
    print(f"== done in {time.perf_counter() - t0:.0f} s" + ("" if code == 0 else " (with errors)"))
    return code


def random_voice_file(folder: Path) -> Path:
    """Seeded random front-end weights (small) in the upstream key layout: real ones cannot be downloaded."""
    import json

    from safetensors.torch import save_file
    from s3flow.model.voice.weights import VOICE_CONFIG_KEY, VoiceConfig, random_voice_state

    path = folder / "voice_random_small_seed0.safetensors"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        save_file(random_voice_state(VoiceConfig.small(), seed=0), str(path),
                  metadata={VOICE_CONFIG_KEY: json.dumps(VoiceConfig.small().to_dict())})
    return path


def make_reference(path: Path, rate: int = 44100) -> Path:
    """A 3 s reference recording made here: espeak-ng speaking a sentence, else a synthetic voiced signal."""
    import shutil
    import subprocess
    import wave

    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    if shutil.which("espeak-ng"):
        raw = subprocess.run(["espeak-ng", "--stdout", "The quick brown fox jumps over the lazy dog."],
                             capture_output=True, check=True).stdout
        tmp = path.with_suffix(".espeak.wav")
        tmp.write_bytes(raw)
        with wave.open(str(tmp), "rb") as f:
            src_rate, pcm = f.getframerate(), np.frombuffer(f.readframes(f.getnframes()), "<i2") / 32768.0
        tmp.unlink()
        t = np.arange(int(len(pcm) * rate / src_rate)) / rate   # to 44.1 kHz (linear: a demo input only)
        samples = np.interp(t, np.arange(len(pcm)) / src_rate, pcm)
    else:
        t = np.arange(3 * rate) / rate
        phase = 2 * np.pi * np.cumsum(120 + 30 * np.sin(2 * np.pi * 0.5 * t)) / rate
        samples = sum(np.sin(k * phase) / k for k in range(1, 15)) * (0.3 + 0.7 * np.sin(2 * np.pi * 2.3 * t) ** 2)
        samples = 0.6 * samples / np.abs(samples).max()
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(rate)
        f.writeframes(np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return path


if __name__ == "__main__":
    sys.exit(main())
