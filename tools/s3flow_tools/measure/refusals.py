"""Refused STARTs hold nothing, measured: with the admission step (the default) and without it, side by side.

Examples::

    .venv/bin/python -m s3flow_tools.measure.refusals                  # -> results/refusals.md (about 5 minutes)
    .venv/bin/python -m s3flow_tools.measure.refusals --refused 64 --out /tmp/refusals.md

Two repositories of the small config on seeded random weights, the cpu target's settings (Triton keeps an idle
sequence 5 + 30 s), differing only in ``RepositorySettings.admission``. On each server, as a plain tritonclient
stream would:

1. **refusals**: ``--refused`` STARTs with a bad token, left without END, then one well-behaved utterance
   (``StreamingClient``): when did its first chunk arrive? Without admission the refused STARTs hold Triton's
   sequence slots for the idle window, and with as many of them as there are slots the new utterance waits in
   Triton's backlog;
2. **cost**: ``--utterances`` utterances streamed one at a time (the client's chunk schedule 10, 20, 40, 80,
   100 tokens, 4 Euler steps), each chunk's latency: what the admission hop adds per chunk.

Exits non-zero when, with admission, the new utterance's first chunk takes 2 s or more.
"""
from __future__ import annotations

import queue
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from s3flow_contract.tensors import request_arrays
from s3flow.engine.settings import SolverSettings
from s3flow.repository.settings import RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance
from s3flow_client.wire import infer_inputs
from s3flow_tools.bench.repos import small_repository
from s3flow_tools.bench.report import log, machine, markdown
from s3flow_tools.measure.command import command

ROOT = Path(__file__).resolve().parents[3]


def refused_then_first_chunk(server, refused: int) -> tuple[float, float]:
    """(seconds to answer the refused STARTs, seconds until a new utterance's first chunk after them)."""
    u = demo_utterance(1.0, seed=1)
    bad = request_arrays(np.array([1, 9999]), start=True, prompt_tokens=u.prompt_tokens, prompt_mel=u.prompt_mel,
                         speaker_embedding=u.speaker_embedding)
    events = queue.Queue()
    client = server.client()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    t0 = time.perf_counter()
    for k in range(refused):
        client.async_stream_infer("token2mel", infer_inputs(bad), sequence_id=10_000_000 + k, sequence_start=True)
    answers = [events.get(timeout=120) for _ in range(refused)]
    answered = time.perf_counter() - t0
    client.stop_stream(cancel_requests=True)
    client.close()
    if not all(error is not None for _, error in answers):
        raise SystemExit("a bad START was not refused")
    good = demo_utterance(1.0, seed=2)
    good.n_timesteps = 4
    began = {}
    t1 = time.perf_counter()
    StreamingClient(server.grpc_url, response_timeout_s=120).synthesize(
        [good], progress=lambda _: began.setdefault("t", time.perf_counter()))
    return answered, began["t"] - t1


def chunk_latencies(server, utterances: int) -> list[float]:
    out = []
    client = StreamingClient(server.grpc_url)
    for k in range(utterances):
        u = demo_utterance(3.0, seed=100 + k, noise_seed=k)
        u.n_timesteps = 4
        [r] = client.synthesize([u])
        out += r.chunk_latencies_s
    return out


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--refused", type=int, default=256, help="refused STARTs left open (default: %(default)s)")
    p.add_argument("--utterances", type=int, default=12, help="utterances for the per-chunk cost (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "refusals.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="refusals-"))
    rows, lat = [], {}
    for admission in (True, False):
        name = "admission" if admission else "direct"
        repo = small_repository(work / name, RepositorySettings(solver=SolverSettings.of(max_steps=20), ort_threads=1,
                                                                admission=admission), seed=5)
        with TritonServer(repo, log_file=work / f"{name}.log") as server:
            lat[admission] = chunk_latencies(server, args.utterances)
            answered, first = refused_then_first_chunk(server, args.refused)
        rows.append((admission, answered, first))
        log(f"admission {admission}: {args.refused} refused in {answered:.2f} s; next first chunk after {first:.2f} s")
    on, off = (np.median(lat[True]) * 1000, np.median(lat[False]) * 1000)
    info = machine()
    lines = ["# Refused STARTs hold nothing: the admission step, measured", "",
             f"Written by `python -m s3flow_tools.measure.refusals` ({time.strftime('%Y-%m-%d')}); the small config "
             f"on seeded "
             f"random weights, the cpu target's settings (idle timeout 5 s, Triton's grace 30 s), one server at a time "
             f"on {info.get('cpu')} ({info.get('cores')} cores).", "",
             f"## {args.refused} STARTs refused for a bad token, left without END, then one new utterance", "",
             markdown(["ensembles", "the refused STARTs answered in", "the new utterance's first chunk after"],
                      [["with admission (default)" if a else "straight to cfm_solver (before)", f"{x:.2f} s",
                        f"{y:.2f} s"] for a, x, y in rows]), "",
             "Without admission every refused START holds one of Triton's sequence slots until its idle window "
             "passes (35 s here); with as many of them as there are slots (256) the new utterance waits in Triton's "
             "backlog. With admission the refusal happens before the sequence batcher and nothing is held.", "",
             f"## What the admission step costs per chunk ({args.utterances} utterances of 3 s, one at a time, "
             f"4 Euler steps, {len(lat[True])} chunks each way)", "",
             markdown(["ensembles", "chunk latency p50", "p90"],
                      [["with admission", f"{on:.1f} ms", f"{np.percentile(lat[True], 90) * 1000:.1f} ms"],
                       ["straight to cfm_solver", f"{off:.1f} ms", f"{np.percentile(lat[False], 90) * 1000:.1f} ms"]]),
             "", f"Median difference: {on - off:+.1f} ms per chunk ({(on - off) / off * 100:+.1f} %).", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())
    return 0 if rows[0][2] < 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
