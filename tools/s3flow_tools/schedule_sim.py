"""Streams through the solver, simulated: Triton's FIFO batching of whole solves vs the step-level scheduler.

Triton-free and in seconds, for 1 to 1,000 streams: how a fleet is sized before a GPU is lent. The step-level
side runs the server's own policy (``s3flow.engine.scheduler.pick``) over the server's own playback clock
(``s3flow.engine.playback``) and prices a call as the server does (``s3flow.engine.capacity.Costs``: an estimator
call's fixed part and part per row x padded frame, the encoder's per call and per token; the server measures its
own online, here they are stated, measured on this host by ``--measure`` or derived from a FLOP count and a
chip's rate); what is modelled is the rest: the encoder's call per batch of new chunks, and the client (an utterance's chunks follow the client's schedule
of 10, 20, 40, 80, 100 tokens; each is sent when the previous one is answered, its tokens being there).

* ``fifo`` (today's ``cfm_solver``): when the instance is free it takes up to ``max_batch`` waiting chunks,
  oldest first, one per stream, and solves them whole (every step) before answering any;
* ``deadline``: every step carries the rows of the in-flight chunks the policy picks within the step budget; a
  chunk is answered after its last step; new chunks join at the next step (their encoder call first).

A stream's player starts at its first answer plus a start-up buffer and plays in real time; when it runs dry it
waits (a stall) and goes on when audio comes. The figures are those of the load test: first audio p50 / p95,
streams that stall (no buffer, 0.3 s), stall seconds p95, and C, the saturation throughput (seconds of audio per
second with every stream ready at once) of FIFO, in whose units the loads are given.

Example::

    .venv/bin/python -m s3flow_tools.schedule_sim                          # the small model on this host's figures
    .venv/bin/python -m s3flow_tools.schedule_sim --gpu h200 --loads 0.5,0.8,1.0 --streams-at-once 256
"""
from __future__ import annotations

import argparse
import heapq
import sys
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from s3flow_contract.tensors import FRAMES_PER_SECOND
from s3flow.engine.capacity import Costs
from s3flow.engine.playback import Playback, PlaybackSettings
from s3flow.engine.scheduler import Candidate, StepBudget, pick

TOKEN_FRAMES = 2
LOOKAHEAD_FRAMES = 6


#: the small trained teacher's estimator (192 x 1 x 2) in ONNX Runtime on this workplace's 2-core hosts: fit of
#: one call's time over rows x frames (2-32 rows, 100-400 frames); its encoder per chunk. Stated: pass --measure
#: to fit it on the host at hand.
SMALL_ON_2_CORES = Costs(est_fixed=2.0e-3, est_per_unit=2.4e-6, enc_fixed=2.0e-3, enc_per_unit=2.0e-5)
#: the full-size estimator (0.1667 GFLOP per row-frame: 100 GFLOP at 2 rows x 300 frames) on one H200 at 30 % of
#: its 989 TFLOP/s dense fp16, 1 ms per call; the encoder 19 GFLOP per 150 tokens
H200_FULL = Costs(est_fixed=1e-3, est_per_unit=0.1667e9 / (0.3 * 989e12), enc_fixed=1e-3,
                  enc_per_unit=19e9 / 150 / (0.3 * 989e12))
#: the stated costs, by name (``--gpu``)
COSTS = {"small teacher, ONNX Runtime, 2 CPU cores (stated)": SMALL_ON_2_CORES,
         "full size on one H200 (30 % of fp16 peak)": H200_FULL}


@dataclass(frozen=True)
class Load:
    """The streams and what each solves: ``seconds`` of audio per utterance, a kept prompt of ``prompt_frames``,
    the bounded context of ``context_frames``, ``steps`` Euler steps, guided (2 rows a step) or not."""
    streams: int
    spread_s: float = 2.0            # arrivals evenly spread over this long (0: at once)
    seconds: float = 4.0
    prompt_frames: int = 50
    context_frames: int = 100
    steps: int = 10
    guided: bool = True
    first_chunk: int = 10
    growth: float = 2.0
    largest_chunk: int = 100

    def chunks(self) -> list[int]:
        n, size, out = int(round(self.seconds * FRAMES_PER_SECOND / TOKEN_FRAMES)), float(self.first_chunk), []
        while n > 0:
            out.append(min(int(size), n))
            n -= out[-1]
            size = min(size * self.growth, self.largest_chunk)
        return out


@dataclass
class _Chunk:
    stream: int
    index: int
    tokens: int
    frames: int            # the solve's frames
    delivers: int          # frames it makes final
    arrival: float
    steps_left: int = 0


@dataclass
class _Stream:
    arrival: float
    plan: list
    emitted: int = 0
    received: int = 0
    first: Optional[float] = None
    answers: list = field(default_factory=list)   # (time, frames delivered)


def _next_chunk(load: Load, s: _Stream, k: int, index: int, now: float) -> _Chunk:
    tokens = s.plan[index]
    last = index == len(s.plan) - 1
    s.received += tokens
    valid = TOKEN_FRAMES * s.received - (0 if last else LOOKAHEAD_FRAMES)
    first = max(0, s.emitted - load.context_frames)
    frames = load.prompt_frames + valid - first
    return _Chunk(k, index, tokens, frames, max(0, valid - s.emitted), now, load.steps)


@dataclass
class Result:
    policy: str
    load: Load
    first_audio: list
    stalls: dict          # start-up buffer -> per-stream stall seconds
    makespan: float
    audio_s: float
    rows_per_call: float

    @property
    def throughput(self) -> float:
        return self.audio_s / self.makespan


def _stalls(answers: list, first: float, buffer_s: float) -> float:
    """A real-time player started at ``first + buffer_s`` that waits whenever it runs dry: seconds it waited."""
    start, had, waited = first + buffer_s, 0, 0.0
    for t, frames in answers:
        due = start + had / FRAMES_PER_SECOND + waited
        if t > due and had:
            waited += t - due
        had += frames
    return waited


def simulate(load: Load, cost: Costs, policy: str, budget: StepBudget = StepBudget(), max_batch: int = 8,
             playback: PlaybackSettings = PlaybackSettings()) -> Result:
    """One run of ``load`` through ``policy`` ("fifo": Triton's whole-solve batching; "deadline" or "arrival":
    the step-level loop with ``s3flow.engine.scheduler.pick`` under that policy)."""
    plan = load.chunks()
    streams = [_Stream(arrival=(load.spread_s * k / max(1, load.streams - 1) if load.streams > 1 else 0.0),
                       plan=plan) for k in range(load.streams)]
    rows = 2 if load.guided else 1
    clocks: dict[int, Playback] = {}   # each stream's playback clock, as the server's sequence table keeps it
    events = [(s.arrival, k, 0) for k, s in enumerate(streams)]   # (time a chunk is sent, stream, chunk index)
    heapq.heapify(events)
    waiting: list[_Chunk] = []
    flight: list[_Chunk] = []
    now, calls, rows_sum = 0.0, 0, 0

    def answer(c: _Chunk, t: float) -> None:
        s = streams[c.stream]
        s.emitted += c.delivers
        if s.first is None:
            s.first = t
        s.answers.append((t, c.delivers))
        clocks[c.stream].delivered(c.delivers, t, playback)
        if c.index + 1 < len(s.plan):
            heapq.heappush(events, (t, c.stream, c.index + 1))

    while events or waiting or flight:
        while events and events[0][0] <= now:
            t, k, index = heapq.heappop(events)
            if index == 0:
                clocks[k] = Playback(arrived=t)
            waiting.append(_next_chunk(load, streams[k], k, index, t))
        if not waiting and not flight:
            now = events[0][0]
            continue
        if policy == "fifo":
            batch, seen = [], set()
            for c in sorted(waiting, key=lambda c: c.arrival):
                if c.stream not in seen and len(batch) < max_batch:
                    batch.append(c)
                    seen.add(c.stream)
            waiting = [c for c in waiting if c not in batch]
            took = cost.encoder_seconds(sum(c.tokens for c in batch)) + load.steps * cost.step_seconds(
                rows * len(batch), max(c.frames for c in batch))
            calls, rows_sum = calls + load.steps, rows_sum + load.steps * rows * len(batch)
            now += took
            for c in batch:
                answer(c, now)
            continue
        if waiting:   # the new chunks' encoder call, then they join the steps
            now += cost.encoder_seconds(sum(c.tokens for c in waiting))
            flight += waiting
            waiting = []
        cands = [Candidate(c, c.arrival, clocks[c.stream].deadline(playback), c.steps_left, rows, c.frames) for c in flight]
        chosen = pick(cands, now, budget, cost.step_seconds, "arrival" if policy == "arrival" else "deadline")
        now += cost.step_seconds(rows * len(chosen), max(c.frames for c in chosen))
        calls, rows_sum = calls + 1, rows_sum + rows * len(chosen)
        for cand in chosen:
            c = cand.key
            c.steps_left -= 1
            if c.steps_left == 0:
                flight.remove(c)
                answer(c, now)
    firsts = [s.first - s.arrival for s in streams]
    stalls = {b: [_stalls(s.answers, s.first, b) for s in streams] for b in (0.0, playback.start_buffer_s)}
    audio = sum(sum(f for _, f in s.answers) for s in streams) / FRAMES_PER_SECOND
    return Result(policy, load, firsts, stalls, now - min(s.arrival for s in streams), audio,
                  rows_sum / max(1, calls))


def saturation(cost: Costs, load: Load, policy: str = "fifo", streams: int = 32) -> float:
    """C: seconds of audio per second with ``streams`` streams ready at once."""
    return simulate(replace(load, streams=streams, spread_s=0.0), cost, policy).throughput


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def table(results: list[tuple[str, Result]], buffer_s: float) -> str:
    head = ("| load | policy | streams | first audio p50 / p95 (ms) | stall (no buffer) | "
            f"stall ({buffer_s:g} s buffer) | stall s p95 ({buffer_s:g} s) | rows per call |")
    lines = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, r in results:
        n = r.load.streams
        no_buf = sum(x > 1e-9 for x in r.stalls[0.0])
        buf = sum(x > 1e-9 for x in r.stalls[buffer_s])
        lines.append(f"| {label} | {r.policy} | {n} | {1000 * _pct(r.first_audio, 50):.0f} / "
                     f"{1000 * _pct(r.first_audio, 95):.0f} | {no_buf} / {n} | {buf} / {n} | "
                     f"{_pct(r.stalls[buffer_s], 95):.2f} | {r.rows_per_call:.1f} |")
    return "\n".join(lines)


def measure_cost(trained: str) -> Costs:
    """Fit the step and encoder costs (``Costs``) on this host: the trained teacher's estimator and encoder in ONNX Runtime."""
    import tempfile
    import time
    from pathlib import Path

    import torch

    from s3flow.model.checkpoint import load_flow
    from s3flow.runtime.onnx_export import export_encoder, export_estimator
    from s3flow.runtime.ort import OrtEncoder, OrtEstimator

    flow = load_flow(trained)
    n_feats = flow.config.n_feats
    with tempfile.TemporaryDirectory() as tmp:
        est_path, enc_path = Path(tmp) / "estimator.onnx", Path(tmp) / "encoder.onnx"
        export_estimator(flow.estimator, est_path)
        export_encoder(flow.encoder, enc_path)
        est, enc = OrtEstimator(est_path), OrtEncoder(enc_path)
        from s3flow.model.solver import EstimatorInputs
        points, times = [], []
        for rows in (2, 8, 16, 32):
            for frames in (100, 200, 400):
                x = torch.randn(rows, n_feats, frames)
                inputs = EstimatorInputs(x=x, mask=torch.ones(rows, 1, frames), mu=x, t=torch.rand(rows),
                                         spks=torch.randn(rows, n_feats), cond=x)
                est(inputs)
                t0 = time.perf_counter()
                for _ in range(3):
                    est(inputs)
                points.append(rows * frames)
                times.append((time.perf_counter() - t0) / 3)
        slope, intercept = np.polyfit(points, times, 1)
        toks = []
        for n in (50, 200):
            tokens = torch.randint(0, 500, (4, n))
            enc(tokens, torch.full((4,), n), torch.randn(4, 192))
            t0 = time.perf_counter()
            enc(tokens, torch.full((4,), n), torch.randn(4, 192))
            toks.append((4 * n, time.perf_counter() - t0))
        tslope = (toks[1][1] - toks[0][1]) / (toks[1][0] - toks[0][0])
    return Costs(est_fixed=max(float(intercept), 0.0), est_per_unit=float(slope),
                 enc_fixed=max(toks[0][1] - tslope * toks[0][0], 0.0), enc_per_unit=max(tslope, 0.0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", choices=("none", "h200"), default="none", help="cost model: this host's, or a GPU's")
    p.add_argument("--measure", metavar="CHECKPOINT", help="fit the cost model on this host with this flow "
                                                           "checkpoint (e.g. checkpoints/trained/teacher.safetensors)")
    p.add_argument("--loads", default="0.5,0.8,0.9,1.0", help="offered loads in units of FIFO's C (%(default)s)")
    p.add_argument("--seconds", type=float, default=4.0, help="audio per utterance (%(default)s)")
    p.add_argument("--steps", type=int, default=10, help="Euler steps, guided (%(default)s)")
    p.add_argument("--max-rows", type=int, default=StepBudget().max_rows, help="step budget: rows (%(default)s)")
    p.add_argument("--max-row-frames", type=int, default=StepBudget().max_row_frames,
                   help="step budget: rows x padded frames (%(default)s)")
    p.add_argument("--streams-at-once", type=int, default=32, help="streams that measure C (%(default)s)")
    args = p.parse_args(argv)
    cost = measure_cost(args.measure) if args.measure else (H200_FULL if args.gpu == "h200" else SMALL_ON_2_CORES)
    budget = StepBudget(args.max_rows, args.max_row_frames)
    base = Load(streams=1, seconds=args.seconds, steps=args.steps)
    c = saturation(cost, base, streams=args.streams_at_once)
    name = "measured here (ONNX Runtime)" if args.measure else next(k for k, v in COSTS.items() if v is cost)
    print(f"costs: {name}; call {cost.est_fixed * 1e3:.2f} ms + {cost.est_per_unit * 1e9:.1f} ns per "
          f"row-frame; step budget {budget.max_rows} rows, {budget.max_row_frames} row-frames")
    print(f"C (FIFO, {args.streams_at_once} streams at once): {c:.1f} s of audio per second; step-level deadline: "
          f"{saturation(cost, base, 'deadline', args.streams_at_once):.1f}")
    results = [("1 stream", simulate(base, cost, policy, budget)) for policy in ("fifo", "deadline")]
    for k in [float(x) for x in args.loads.split(",")]:
        n = max(1, round(k * c))
        for spread in (2.0, 0.0):
            for policy in ("fifo", "deadline"):
                label = f"{k:g} C {'over 2 s' if spread else 'at once'}"
                results.append((label, simulate(replace(base, streams=n, spread_s=spread), cost, policy, budget)))
    print(table(results, PlaybackSettings().start_buffer_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
