"""Tokens arriving live (a text-to-token model's pace): first audio and stalls, live chunking vs the fixed schedule.

Examples::

    .venv/bin/python -m s3flow_tools.measure.live                       # -> results/live_client.md
    .venv/bin/python -m s3flow_tools.measure.live --quick --out /tmp/live.md

One real tritonserver serving ``token2wav`` with the shipped small model (``checkpoints/trained/``: the 2-step
meanflow student, the trained vocoder; ``--checkpoint`` for another flow checkpoint), 4 s utterances of the
held-out set's tokens. Each utterance's tokens are pushed from the START at 25, 50 or 100 per second (1x, 2x,
4x real time) in bursts of 2 by a feeder thread per utterance, alone and 8 at once. Two ways to cut chunks:

* **live**: ``s3flow_client.chunking.LiveChunks`` (the client's default): a 10-token first chunk, then
  chunks as large as the audio in hand allows, never waiting for tokens that do not exist;
* **fixed**: the batch client's schedule (10, 20, 40, 80, 100 tokens), each chunk sent once its tokens exist.

Per cell (median over utterances): first audio (START to the first response with sound), the all-tokens-ready
first audio for reference, stalls of a real-time player that starts at the first audio (``start buffer 0``)
and one that holds 0.5 s first, and how long the player ran dry in all.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from s3flow_contract.tensors import TOKENS_PER_SECOND
from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.vocoder import load_vocoder
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import LiveChunks, LiveClient, StreamingClient, Utterance, chunk_schedule
from s3flow_client.chunking import PlannedChunks
from s3flow_client.live import stalls
from s3flow_tools.bench.report import log, machine, markdown
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import TRAINED
from s3flow_training.package import load_heldout

ROOT = Path(__file__).resolve().parents[3]
RATES = tuple(k * TOKENS_PER_SECOND for k in (1.0, 2.0, 4.0))   # tokens pushed a second: 1x, 2x, 4x


def utterances(n: int, seconds: float) -> list[Utterance]:
    held = load_heldout(TRAINED / "heldout.npz")
    out = []
    for k in range(n):
        u = held[k % len(held)]
        tokens = np.concatenate([held[(k + j) % len(held)].speech_tokens for j in range(4)])
        tokens = tokens[:int(TOKENS_PER_SECOND * seconds)]
        out.append(Utterance(tokens, u.prompt_tokens, np.ascontiguousarray(u.prompt_mel.T), u.xvector, seed=k))
    return out


def run_cell(url: str, utts: list[Utterance], rate: float, mode: str) -> list[dict]:
    """Every utterance fed at ``rate`` tokens/s at once; per utterance its first audio and pieces."""
    import threading
    with LiveClient(url, "token2wav", response_timeout_s=120) as client:
        streams = []
        for u in utts:
            chunking = LiveChunks() if mode == "live" else PlannedChunks(chunk_schedule(len(u.speech_tokens)))
            streams.append(client.open(u.prompt_tokens, u.prompt_mel, u.speaker_embedding, seed=u.seed,
                                       chunking=chunking))

        def feed(stream, tokens):
            t0 = time.perf_counter()
            for k in range(0, len(tokens), 2):
                delay = t0 + (k + 2) / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                stream.push(tokens[k:k + 2])
            stream.end()

        feeders = [threading.Thread(target=feed, args=(s, u.speech_tokens)) for s, u in zip(streams, utts)]
        for f in feeders:
            f.start()
        results = [s.result() for s in streams]
        for f in feeders:
            f.join()
    out = []
    for s, r in zip(streams, results):
        if r.error:
            raise RuntimeError(r.error)
        out.append({"first_audio": r.first_audio_s, "pieces": s.pieces, "sizes": s.sizes})
    return out


def ready_first_audio(url: str, utts: list[Utterance]) -> float:
    """First audio with every token in hand (the batch client), median over the utterances, one at a time."""
    client = StreamingClient(url, "token2wav", timeout_s=300)
    return statistics.median(client.synthesize([u])[0].first_audio_s for u in utts)


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--checkpoint", type=Path, default=TRAINED / "student.safetensors", help="(default: %(default)s)")
    p.add_argument("--seconds", type=float, default=4.0, help="utterance length (default: %(default)s)")
    p.add_argument("--concurrent", type=int, default=8, help="streams at once in the loaded cells (default: 8)")
    p.add_argument("--quick", action="store_true", help="2 streams, 1x and 2x only")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "live_client.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    rates = RATES[:2] if args.quick else RATES
    many = 2 if args.quick else args.concurrent
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="live-"))
    flow = load_flow(args.checkpoint)
    write_repository(work / "repo", flow, RepositorySettings(solver=SolverSettings.of(max_live_sequences=32),
                                                             ort_threads=2),
                     vocoder=load_vocoder(TRAINED / "vocoder.safetensors"))
    rows = []
    with TritonServer(work / "repo", log_file=work / "server.log") as server:
        utts = utterances(max(many, 3), args.seconds)
        ready_first_audio(server.grpc_url, utts[:1])   # warm-up
        ready = ready_first_audio(server.grpc_url, utts[:3])
        log(f"all tokens ready: first audio {1000 * ready:.0f} ms")
        for n in (1, many):
            for rate in rates:
                for mode in ("live", "fixed"):
                    got = run_cell(server.grpc_url, utts[:n], rate, mode)
                    first = statistics.median(g["first_audio"] for g in got)
                    st0 = [stalls(g["pieces"], 0.0, 24000.0) for g in got]
                    st5 = [stalls(g["pieces"], 0.5, 24000.0) for g in got]
                    row = {"streams": n, "rate": rate, "mode": mode, "first_audio_s": first,
                           "first_tokens_s": 10 / rate, "ready_first_audio_s": ready,
                           "stalls_0": sum(c for c, _ in st0), "dry_0_s": sum(d for _, d in st0),
                           "stalls_05": sum(c for c, _ in st5), "dry_05_s": sum(d for _, d in st5),
                           "chunks": got[0]["sizes"]}
                    rows.append(row)
                    log(f"{n} stream(s), {rate:g} tokens/s, {mode}: first audio {1000 * first:.0f} ms, stalls "
                        f"{row['stalls_0']} ({row['dry_0_s']:.2f} s) / with 0.5 s buffer {row['stalls_05']}")
    write_report(args, rows, ready, time.perf_counter() - t0)
    return 0


def write_report(args, rows, ready: float, wall_s: float) -> None:
    header = ["streams", "tokens/s", "chunking", "first audio", "target", "stalls (dry s), no buffer",
              "stalls (dry s), 0.5 s buffer", "chunks of stream 1"]
    body = []
    for r in rows:
        target = r["first_tokens_s"] + 1.2 * r["ready_first_audio_s"]
        body.append([str(r["streams"]), f"{r['rate']:g} ({r['rate'] / TOKENS_PER_SECOND:g}x)", r["mode"],
                     f"{1000 * r['first_audio_s']:.0f} ms", f"<= {1000 * target:.0f} ms",
                     f"{r['stalls_0']} ({r['dry_0_s']:.2f})", f"{r['stalls_05']} ({r['dry_05_s']:.2f})",
                     str(r["chunks"])])
    L = ["# Live client: tokens arriving while the utterance streams", "",
         f"Written by `python -m s3flow_tools.measure.live{' --quick' if args.quick else ''}` "
         f"({time.strftime('%Y-%m-%d')}, "
         f"{wall_s / 60:.1f} min; {json.dumps(machine())}); checkpoint `{args.checkpoint.relative_to(ROOT)}`, "
         f"token2wav with the trained vocoder, {args.seconds:g} s utterances; the script's docstring says what "
         "each column is.", "",
         f"First audio with every token in hand (the batch client, one stream): **{1000 * ready:.0f} ms**. Target "
         "for a live stream: the time its first chunk's 10 tokens take to arrive plus 1.2x that; 0 stalls at 2x "
         "real time.", "", markdown(header, body), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(L))
    print("\n".join(L))


if __name__ == "__main__":
    sys.exit(main())
