"""Served streaming loads and Triton's per-model statistics, for the benchmark and the batching sweep.

:func:`run_load` streams utterances all at once (cross-utterance batching) or one after the other and
measures throughput and chunk latencies; :class:`ServerStats` reads what the models did meanwhile (Triton's
statistics: compute time, requests, executions). Client-side only (tritonclient, numpy)::

    utts = batching_load(4, seconds=2.0, prompt_seconds=1.0, steps=10)
    together = run_load(url, utts, concurrent=True, server=server)
    alone = [run_load(url, [u], concurrent=False, server=server) for u in utts]
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from s3flow.server.access import admin_headers
from s3flow_client.demo import demo_utterance
from s3flow_client.stream import StreamError, StreamingClient, Utterance, chunk_schedule
from s3flow_tools.bench.report import SCHEDULE, Report, log


def model_stats(client) -> dict:
    """{model: (executions, compute_infer ns)} of every model, from Triton's statistics."""
    out = {}
    for m in client.get_inference_statistics(as_json=True, headers=admin_headers()).get("model_stats", []):
        compute = int(m.get("inference_stats", {}).get("compute_infer", {}).get("ns", 0))
        out[m["name"]] = (int(m.get("execution_count", 0)), compute)
    return out


class ServerStats:
    """Deltas of Triton's per-model statistics (compute_infer time, requests, executions)."""

    MODELS = ("cfm_solver", "flow_encoder", "estimator")

    def __init__(self, server):
        """``server``: a running ``s3flow.server.triton_server.TritonServer`` (its ``client()``)."""
        self.client = server.client()
        self.before = self._read()

    def _read(self) -> dict:
        out = {}
        for m in self.MODELS:
            s = self.client.get_inference_statistics(m, headers=admin_headers()).model_stats[0]
            out[m] = (s.inference_stats.compute_infer.ns / 1e9, int(s.inference_count), int(s.execution_count))
        return out

    def delta(self) -> dict:
        after = self._read()
        return {m: tuple(a - b for a, b in zip(after[m], self.before[m])) for m in self.MODELS}


@dataclass
class LoadResult:
    streams: int
    audio_s: float                 # audio of the utterances that completed
    wall_s: float
    latencies: list                # every chunk's latency (s)
    first_chunks: list = field(default_factory=list)
    requests: int = 0              # cfm_solver requests and executions (Triton statistics)
    executions: int = 0
    errors: list = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.audio_s / self.wall_s


def batching_load(n_streams: int, seconds: float, prompt_seconds: float, steps: Optional[int]) -> list[Utterance]:
    """n_streams utterances of about ``seconds`` (lengths vary by +-20 %), each with its own voice and seed."""
    out = []
    for i in range(n_streams):
        length = seconds * (1.0 + 0.2 * ((i % 5) - 2) / 2)
        u = demo_utterance(length, seed=300 + i, noise_seed=i, prompt_seconds=prompt_seconds)
        u.chunks = chunk_schedule(len(u.speech_tokens), *SCHEDULE)
        u.n_timesteps = steps
        out.append(u)
    return out


def run_load(url: str, utts: list[Utterance], concurrent: bool, server=None,
             stagger_s: float = 0.0, timeout_s: float = 3600.0) -> LoadResult:
    """Stream utts all at once (one gRPC stream; or, with ``stagger_s`` > 0, one client each, started that
    many seconds apart), or one after the other; measure the wall time. Failed utterances are counted in
    ``errors``, not raised."""
    client = StreamingClient(url, timeout_s=timeout_s)
    stats = ServerStats(server) if server is not None else None
    results, errors = [], []

    def one(batch):
        try:
            results.extend(client.synthesize(batch))
        except StreamError as exc:
            results.extend(r for r in exc.results if r.error is None)
            errors.extend(r.error for r in exc.results if r.error is not None)

    t0 = time.perf_counter()
    if not concurrent:
        for u in utts:
            one([u])
    elif stagger_s <= 0:
        one(utts)
    else:
        threads = [threading.Thread(target=one, args=([u],)) for u in utts]
        for k, th in enumerate(threads):
            time.sleep(max(t0 + k * stagger_s - time.perf_counter(), 0.0))
            th.start()
        for th in threads:
            th.join()
    wall = time.perf_counter() - t0
    load = LoadResult(streams=len(utts), audio_s=sum(r.audio_s for r in results), wall_s=wall,
                      latencies=[x for r in results for x in r.chunk_latencies_s],
                      first_chunks=[r.first_chunk_s for r in results], errors=errors)
    if stats is not None:
        d = stats.delta()["cfm_solver"]
        load.requests, load.executions = d[1], d[2]
    return load


def measure_batching(server, n_feats: int, args, report: Report, steps: Optional[int]) -> None:
    streams = args.streams
    utts = batching_load(max(streams), args.batch_seconds, args.prompt_seconds, steps)
    log(f"batching ({report.batching_size}): {max(streams)} utterances of ~{args.batch_seconds:g} s, "
        f"each alone, then {streams} at once")
    run_load(server.grpc_url, utts[:1], concurrent=False)   # warm-up
    alone = [run_load(server.grpc_url, [u], concurrent=False, server=server) for u in utts]
    for n in streams:
        together = run_load(server.grpc_url, utts[:n], concurrent=True, server=server)
        for err in together.errors + [e for a in alone[:n] for e in a.errors]:
            report.failures.append(f"batching, {n} streams: {err}")
        one_by_one = LoadResult(streams=n, audio_s=sum(a.audio_s for a in alone[:n]),
                                wall_s=sum(a.wall_s for a in alone[:n]),
                                latencies=[x for a in alone[:n] for x in a.latencies],
                                requests=sum(a.requests for a in alone[:n]),
                                executions=sum(a.executions for a in alone[:n]))
        report.batching.append((together, one_by_one))
        log(f"  {n} streams: {together.throughput:.2f} audio s/s together vs {one_by_one.throughput:.2f} one at "
            f"a time ({together.requests / max(together.executions, 1):.2f} chunks per execute)")
