#!/usr/bin/env python3
"""The main job: build the model repository, start tritonserver, stream one utterance, write outputs, stop.

Examples::

    .venv/bin/python scripts/demo.py                      # the small model trained here, its held-out demo
    .venv/bin/python scripts/demo.py --meanflow           # the same with its 2-step meanflow student
    .venv/bin/python scripts/demo.py --size full          # full size (71 M estimator), seeded random weights
    .venv/bin/python scripts/demo.py --checkpoint s3gen.safetensors --inputs utt.npz
    .venv/bin/python scripts/demo.py --voice              # start by a voice registered from a reference wav
    .venv/bin/python scripts/demo.py --text "Good morning, how are you?" --speaker 3   # needs espeak-ng

``--size small`` (the default) serves ``checkpoints/trained/teacher.safetensors`` (``student.safetensors``
with ``--meanflow``) with the HiFT vocoder trained here (``checkpoints/trained/vocoder.safetensors``) and
streams ``checkpoints/trained/demo_utt.npz``, a held-out sentence whose ground truth mel is drawn above the
streamed one. ``--text`` speaks a sentence of your own instead: espeak-ng says it in corpus voice
``--speaker`` (0-7), the corpus' codebook turns that into speech tokens (``checkpoints/trained/frontend.npz``:
the small model's stand-in for T3), and the prompt is a held-out recording of the same voice. ``--size
full`` serves seeded random weights of the real size (for cost measurements: the spectrogram is noise).

Writes ``out/mel_0.npy`` (80 x frames), ``out/mel_0.png``, ``out/audio_0.wav`` (24 kHz, written as it streams)
and ``out/audio_0.png`` (waveform over spectrogram), and prints first-chunk latency, per-chunk
latency, the real-time factor, and, where the input carries its recording (the demo sentence, ``--text``),
the intelligibility of the streamed audio against it (STOI / ESTOI, ``s3flow_training.intelligibility``).
The server listens on 127.0.0.1 only and is stopped (by PID) at the end. Exits non-zero if any step fails.

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
    p.add_argument("--vocoder-checkpoint", type=Path, help="mel2wav.* tensors (default: the small model's trained "
                   "vocoder; a user's checkpoint brings its own)")
    p.add_argument("--text", help="speak this sentence (small model; espeak-ng makes its tokens and recording)")
    p.add_argument("--speaker", type=int, default=0, help="the corpus voice (0-7) that --text is spoken in "
                   "(default: %(default)s)")
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
        if args.text:
            args.inputs = text_input(args.text, args.speaker, args.out_dir / "text_utt.npz")
        if not args.no_audio and args.vocoder_checkpoint is None:
            args.vocoder_checkpoint = TRAINED / "vocoder.safetensors"
    elif args.text:
        p.error("--text needs the small model trained here (--size small, no --checkpoint)")

    from s3flow.repository import cli as build_repository
    from s3flow.server.triton_server import TritonServer
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
        elif args.vocoder_checkpoint:
            build += ["--vocoder-checkpoint", str(args.vocoder_checkpoint)]
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
    if code == 0 and not args.no_audio and args.inputs:
        report_intelligibility(args.inputs, args.out_dir / "audio_0.wav")
    print(f"== done in {time.perf_counter() - t0:.0f} s" + ("" if code == 0 else " (with errors)"))
    return code


def text_input(text: str, speaker: int, path: Path) -> Path:
    """An input file for ``text``: tokens from espeak-ng's recording of it in corpus voice ``speaker`` (the
    corpus' front-end), a prompt from the first held-out utterance of that voice, the recording as reference."""
    import dataclasses

    from s3flow_contract.tensors import TOKENS_PER_SECOND
    from s3flow_training.data import espeak_available
    from s3flow_training.intelligibility import RATE, to_16k
    from s3flow_training.package import Frontend, load_heldout, save_demo_input

    if not espeak_available():
        raise SystemExit("error: --text needs espeak-ng (`make demo TEXT=...` installs it; or apt-get install -y "
                         "espeak-ng)")
    frontend = Frontend.load(TRAINED / "frontend.npz")
    tokens, mel, audio = frontend.speak(text, speaker)
    anchor = next((u for u in load_heldout(TRAINED / "heldout.npz") if u.voice == speaker), None)
    if anchor is None:
        raise SystemExit(f"error: no held-out utterance of voice {speaker} to prompt from")
    utt = dataclasses.replace(anchor, speech_tokens=tokens, mel=mel, text=text, reference=to_16k(audio, 24000))
    print(f"== {text!r} in voice {speaker} ({frontend.voices[speaker].name}): {len(tokens)} tokens "
          f"({len(tokens) / TOKENS_PER_SECOND:.2f} s), recording at {RATE} Hz kept as the reference")
    return save_demo_input(path, utt)


def report_intelligibility(inputs: Path, wav: Path) -> None:
    """Print STOI / ESTOI of the streamed audio against the recording the input file carries (if any)."""
    import numpy as np
    from s3flow_client.audio import read_wav

    with np.load(inputs) as d:
        if "reference" not in d.files:
            return
        reference, rate = d["reference"].astype(np.float32) / 32768.0, int(d["reference_rate"])
    from s3flow_training.intelligibility import intelligibility

    audio, audio_rate = read_wav(wav)
    score = intelligibility(reference, audio, rate, audio_rate)
    print(f"  intelligibility of out/{wav.name} against the recording: STOI {score.stoi:.3f}, "
          f"ESTOI {score.estoi:.3f} (white noise scores 0.36 / 0.00, the recording itself 1 / 1)")


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

    import numpy as np
    from s3flow_client.audio import read_wav, write_wav

    path.parent.mkdir(parents=True, exist_ok=True)
    if shutil.which("espeak-ng"):
        tmp = path.with_suffix(".espeak.wav")
        subprocess.run(["espeak-ng", "-w", str(tmp), "The quick brown fox jumps over the lazy dog."],
                       capture_output=True, check=True)
        pcm, src_rate = read_wav(tmp)
        tmp.unlink()
        t = np.arange(int(len(pcm) * rate / src_rate)) / rate   # to 44.1 kHz (linear: a demo input only)
        samples = np.interp(t, np.arange(len(pcm)) / src_rate, pcm)
    else:
        t = np.arange(3 * rate) / rate
        phase = 2 * np.pi * np.cumsum(120 + 30 * np.sin(2 * np.pi * 0.5 * t)) / rate
        samples = sum(np.sin(k * phase) / k for k in range(1, 15)) * (0.3 + 0.7 * np.sin(2 * np.pi * 2.3 * t) ** 2)
        samples = 0.6 * samples / np.abs(samples).max()
    return write_wav(path, samples, rate)


if __name__ == "__main__":
    sys.exit(main())
