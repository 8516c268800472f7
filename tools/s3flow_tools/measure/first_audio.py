"""First audio: how the first response of token2wav can carry sound, measured on the trained small model.

Examples::

    .venv/bin/python -m s3flow_tools.measure.first_audio                 # -> results/first_audio.md
    .venv/bin/python -m s3flow_tools.measure.first_audio --utterances 4 --no-served --out /tmp/first_audio.md

The vocoder withholds its last ``lookahead_frames`` (20 frames, 400 ms) of audio until more mel exists, so that
streamed audio equals offline vocoding; the client's first chunk of 10 tokens makes only 14 final frames, and
the first response carries no audio. Candidates, each on the shipped held-out sentences (teacher, guided 10
steps, bounded context; the trained vocoder):

* **today**: lookahead 20, the client's schedule (10, 20, 40, 80, 100 tokens);
* **a bigger first chunk**: 20 tokens first (34 final frames: 14 frames of audio at once), then the schedule;
* **a smaller first lookahead** (``StreamSettings.first_lookahead_frames``, 0 / 4 / 8 frames): the first
  response carries audio up to that close to its last frame; the next response cross-fades into the exact
  stream.

For each: which response first carries sound, the largest difference from offline vocoding of the same mel in
the first 0.5 s and after it, the log-spectral distance of the first 0.5 s to offline vocoding, and whole-
utterance ESTOI against the recording (offline vocoding's beside it). ``--served`` (the default) also measures
first mel (token2mel) and first audio (token2wav) against a real tritonserver, alone, for today's settings and
the chosen default. Exits non-zero when the chosen default breaks exactness after 0.5 s (1e-5) or loses more
than 0.02 ESTOI.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from s3flow.engine.vocoder_stream import SERVED_FIRST_LOOKAHEAD_FRAMES, StreamSettings, VocoderStream
from s3flow.model.checkpoint import load_flow
from s3flow.model.vocoder import load_vocoder
from s3flow.runtime.torch_vocoder import TorchVocoder
from s3flow.model.vocoder_source import offline_vocode
from s3flow_client import chunk_schedule
from s3flow_training.evaluate import stream_utterance
from s3flow_training.intelligibility import intelligibility, log_spectral_distance
from s3flow_training.package import load_heldout
from s3flow_tools.bench.report import log, machine, markdown
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import TRAINED

ROOT = Path(__file__).resolve().parents[3]
SR, HALF_S = 24000, 12000
#: The first lookahead the served default uses (what this script chose; results/first_audio.md).
DEFAULT_FIRST_LOOKAHEAD = SERVED_FIRST_LOOKAHEAD_FRAMES


@dataclass(frozen=True)
class Candidate:
    name: str
    first_chunk: int            # tokens of the client's first chunk
    first_lookahead: int        # -1: the regular lookahead


CANDIDATES = (Candidate("today: lookahead 20, first chunk 10", 10, -1),
              Candidate("first chunk of 20 tokens", 20, -1),
              Candidate("first lookahead 8 frames", 10, 8),
              Candidate("first lookahead 4 frames", 10, 4),
              Candidate("first lookahead 0 frames", 10, 0))


def schedule(n: int, first: int) -> list[int]:
    rest = chunk_schedule(max(n - first, 0), 20, 2.0, 100) if n > first else []
    return [min(first, n)] + rest


def vocode_stream(runner: TorchVocoder, params, settings: StreamSettings, mel_chunks: list[np.ndarray]):
    """Stream mel chunks through a VocoderStream; (per-response sample counts, the audio)."""
    stream = VocoderStream(runner.f0, runner.decode, params, settings)
    state, offset, sizes, parts = stream.start(seed=0), 0, [], []
    for k, m in enumerate(mel_chunks):
        state, chunk = stream.push(state, m, offset, end=k == len(mel_chunks) - 1)
        offset += m.shape[1]
        sizes.append(chunk.audio.size)
        parts.append(chunk.audio)
    return sizes, np.concatenate(parts)


def measure_in_process(utts, teacher, hift) -> list[dict]:
    runner = TorchVocoder(hift)
    params = hift.source_params
    rows = []
    for c in CANDIDATES:
        first_sound, early, late, lsd, estoi, estoi_off = [], [], [], [], [], []
        for k, u in enumerate(utts):
            sizes = schedule(len(u.speech_tokens), c.first_chunk)
            got = stream_utterance(teacher, u, sizes, seed=k)
            bounds = [0] + [r for r in got.seams] + [got.mel.shape[1]]
            mel_chunks = [got.mel[:, a:b] for a, b in zip(bounds, bounds[1:])]
            settings = StreamSettings(first_lookahead_frames=c.first_lookahead)
            samples, audio = vocode_stream(runner, params, settings, mel_chunks)
            offline = offline_vocode(runner.f0, runner.decode, got.mel, params, seed=0)
            diff = np.abs(audio - offline)
            first_sound.append(next((i for i, n in enumerate(np.cumsum(samples)) if n > 960), len(samples)) + 1)
            early.append(float(diff[:HALF_S].max()))
            late.append(float(diff[HALF_S:].max()) if diff.size > HALF_S else 0.0)
            lsd.append(log_spectral_distance(offline[:HALF_S], audio[:HALF_S], SR, SR))
            estoi.append(intelligibility(u.reference, audio).estoi)
            estoi_off.append(intelligibility(u.reference, offline).estoi)
        rows.append({"candidate": c, "first_sound_response": float(np.mean(first_sound)),
                     "max_diff_first_half_s": max(early), "max_diff_after": max(late),
                     "lsd_first_half_s": float(np.mean(lsd)), "estoi": float(np.mean(estoi)),
                     "estoi_offline": float(np.mean(estoi_off))})
        log(f"{c.name}: first sound in response {rows[-1]['first_sound_response']:.2f}, "
            f"ESTOI {rows[-1]['estoi']:.3f} (offline {rows[-1]['estoi_offline']:.3f})")
    return rows


def measure_served(utts, first_lookahead: int, work: Path) -> dict:
    """First mel (token2mel) and first audio (token2wav), one utterance at a time, client schedule."""
    from s3flow.repository import cli as build_repository
    from s3flow.server.triton_server import TritonServer
    from s3flow_client import StreamingClient, Utterance

    repo = work / f"repo_first{first_lookahead}"
    if build_repository.main(["--checkpoint", str(TRAINED / "teacher.safetensors"), "--vocoder-checkpoint",
                              str(TRAINED / "vocoder.safetensors"), "--output", str(repo), "--no-voice",
                              "--vocoder-first-lookahead-frames", str(first_lookahead)]) != 0:
        raise SystemExit("building the repository failed")
    out = {"token2mel": [], "token2wav": []}
    with TritonServer(repo, log_file=work / f"{repo.name}.log") as server:
        for model in out:
            client = StreamingClient(server.grpc_url, model=model)
            for k, u in enumerate(utts):
                [r] = client.synthesize([Utterance(u.speech_tokens, u.prompt_tokens,
                                                   np.ascontiguousarray(u.prompt_mel.T), u.xvector, seed=k)])
                out[model].append(r.first_audio_s if model == "token2wav" else r.first_chunk_s)
    return {m: float(np.median(v)) for m, v in out.items()}


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--utterances", type=int, default=16, help="held-out utterances (default: %(default)s)")
    p.add_argument("--served", action=argparse.BooleanOptionalAction, default=True, help="(default: on)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=ROOT / "results" / "first_audio.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    teacher, hift = load_flow(TRAINED / "teacher.safetensors"), load_vocoder(TRAINED / "vocoder.safetensors")
    utts = load_heldout(TRAINED / "heldout.npz")[:args.utterances]
    rows = measure_in_process(utts, teacher, hift)
    served = {}
    if args.served:
        with tempfile.TemporaryDirectory() as tmp:
            for first in (-1, DEFAULT_FIRST_LOOKAHEAD):
                served[first] = measure_served(utts, first, Path(tmp))
                log(f"served, first lookahead {first}: {served[first]}")
    info = machine()
    lines = ["# First audio: the first response of token2wav carries sound", "",
             f"Written by `python -m s3flow_tools.measure.first_audio` ({time.strftime('%Y-%m-%d')}): the trained "
             f"small model "
             f"(teacher, guided 10 steps, bounded context) and its trained vocoder, {len(utts)} held-out sentences, "
             f"{info.get('cpu')} ({info.get('cores')} cores). First sound: the response (1 = the first) whose samples "
             f"first reach beyond the silent, faded-in first 40 ms. Differences are against offline vocoding of the "
             f"same streamed mel (so they measure the audio stream alone).", "",
             markdown(["candidate", "first sound in response", "max |diff|, first 0.5 s", "max |diff| after 0.5 s",
                       "log-spectral distance, first 0.5 s (dB)", "ESTOI", "ESTOI, offline vocoding"],
                      [[r["candidate"].name, f"{r['first_sound_response']:.2f}", f"{r['max_diff_first_half_s']:.2e}",
                        f"{r['max_diff_after']:.1e}", f"{r['lsd_first_half_s']:.2f}", f"{r['estoi']:.3f}",
                        f"{r['estoi_offline']:.3f}"] for r in rows]), ""]
    if served:
        lines += ["## Served, one utterance at a time (median seconds from the START)", "",
                  markdown(["vocoder first lookahead", "first mel (token2mel)", "first audio (token2wav)",
                            "first audio / first mel"],
                           [[("20 (today)" if f < 0 else f"{f} (default)"), f"{v['token2mel'] * 1000:.0f} ms",
                             f"{v['token2wav'] * 1000:.0f} ms", f"{v['token2wav'] / v['token2mel']:.2f}"]
                            for f, v in served.items()]), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())
    chosen = next(r for r in rows if r["candidate"].first_lookahead == DEFAULT_FIRST_LOOKAHEAD)
    ok = chosen["max_diff_after"] <= 1e-5 and chosen["estoi"] >= chosen["estoi_offline"] - 0.02
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
