"""Streams of any length, measured: one long utterance through token2wav of a real tritonserver, bounded context.

Examples::

    .venv/bin/python -m s3flow_tools.measure.long_stream                    # 10 minutes -> results/long_stream.md
    .venv/bin/python -m s3flow_tools.measure.long_stream --minutes 2 --out /tmp/long.md

The small config on seeded random weights (the cost and the state do not depend on the weights), a 1 s prompt,
chunks of 10, 40, then 100 tokens, one Euler step per chunk (``--steps``) so ten minutes of audio stream in a
few minutes on 2 cores. Reports: the offsets (exact, 2 frames per token, 480 samples per frame: checked by the
client on every response), the latency of the full-size chunks (the last 10 % against the first 10 %), the
server's resident memory at each minute of audio (its process tree's RSS), and the audio's continuity at every
seam (each response's first sample continues the last one's offset). Exits non-zero when a check fails:
latency last/first above 1.25, memory from minute 1 to the end above +10 %, any offset or sample count wrong.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from s3flow_contract.tensors import TOKENS_PER_SECOND
from s3flow.engine.settings import SolverSettings
from s3flow.repository.settings import RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance
from s3flow_tools.bench.repos import small_repository
from s3flow_tools.bench.report import log, machine, markdown
from s3flow_tools.measure.command import command

ROOT = Path(__file__).resolve().parents[3]
LATENCY_BOUND, MEMORY_BOUND = 1.25, 0.10


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--minutes", type=float, default=10.0, help="utterance length (default: %(default)s)")
    p.add_argument("--steps", type=int, default=1, help="Euler steps per chunk (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "long_stream.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="long-stream-"))
    repo = small_repository(work, RepositorySettings(solver=SolverSettings.of(max_steps=max(4, args.steps)),
                                                     ort_threads=1), seed=6, vocoder=True)
    u = demo_utterance(60 * args.minutes, seed=7)
    n = len(u.speech_tokens)
    rest = n - 50
    u.n_timesteps, u.chunks = args.steps, [10, 40] + [100] * (rest // 100) + ([rest % 100] if rest % 100 else [])
    rss, marks = [], []
    with TritonServer(repo, log_file=work / "server.log") as server:
        frames = [0]

        def progress(_):
            done = len(marks) + 1
            marks.append(time.perf_counter())
            if done % 15 == 0 or done == len(u.chunks):   # every 15 chunks = 1 minute of audio at 100 tokens
                rss.append((frames[0], server.rss_bytes()))

        def on_audio(_, samples):
            frames[0] += samples.size // 480

        t0 = time.perf_counter()
        [r] = StreamingClient(server.grpc_url, model="token2wav").synthesize([u], progress=progress, on_audio=on_audio)
        wall = time.perf_counter() - t0
    lat = r.chunk_latencies_s
    full = [x for x, size in zip(lat, u.chunks) if size == 100]
    k = max(1, len(full) // 10)
    ratio = float(np.mean(full[-k:]) / np.mean(full[:k]))
    minute = [b for f, b in rss if f >= 3000]
    growth = (minute[-1] - minute[0]) / minute[0] if len(minute) >= 2 else float("nan")
    exact = (r.error is None and r.mel.shape == (80, 2 * n) and r.audio.shape == (480 * 2 * n,)
             and sum(r.chunk_samples) == 480 * 2 * n)
    ok = exact and ratio <= LATENCY_BOUND and growth <= MEMORY_BOUND
    info = machine()
    lines = [f"# A {args.minutes:g}-minute stream through token2wav (bounded context)", "",
             f"Written by `python -m s3flow_tools.measure.long_stream` ({time.strftime('%Y-%m-%d')}): the small "
             f"config on seeded "
             f"random weights with a small HiFT, {args.steps} Euler step(s) per chunk, one utterance of {n} tokens "
             f"({2 * n} frames, {n / TOKENS_PER_SECOND / 60:.1f} min of audio) in {len(u.chunks)} chunks "
             f"(10, 40, then 100 tokens), one server on {info.get('cpu')} ({info.get('cores')} cores). "
             f"Wall time {wall:.0f} s.", "",
             markdown(["check", "measured", "target"], [
                 ["offsets exact, 2 frames per token, 480 samples per frame (client-checked every response)",
                  "yes" if exact else f"NO: {r.error}", "yes"],
                 ["latency of the full-size chunks, last 10 % / first 10 %",
                  f"{ratio:.2f} ({1000 * np.mean(full[-k:]):.0f} / {1000 * np.mean(full[:k]):.0f} ms)",
                  f"<= {LATENCY_BOUND}"],
                 ["server memory (RSS of its process tree), minute 1 to the end",
                  f"{growth * 100:+.1f} % ({minute[0] / 2**20:.0f} -> {minute[-1] / 2**20:.0f} MiB)" if minute else "-",
                  f"<= +{MEMORY_BOUND * 100:.0f} %"],
                 ["retries, resumes", f"{len(r.retries)}, {len(r.resumes)}", "0, 0"]]), "",
             "## Memory per minute of audio", "",
             markdown(["frames delivered", "minute", "server RSS (MiB)"],
                      [[str(f), f"{f / 3000:.1f}", f"{b / 2**20:.0f}"] for f, b in rss]), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())
    log("all checks passed" if ok else "a check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
