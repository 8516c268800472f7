"""What one H200 would carry: the simulator over the full-size model priced for one GPU (issue 51).

Example::

    .venv/bin/python -m s3flow_tools.measure.projection                       # -> results/projection.md
    .venv/bin/python -m s3flow_tools.measure.projection --measured results/gpu_check.json   # the GPU's own figures

The server's own solver code on a virtual clock (``s3flow_tools.sim``: the engine's plan, Triton's batcher or the
deadline loop, the client's chunks; checked against the real server cell by cell in results/qos.md), with every
call priced for the full-size model on one GPU. The assumptions, each a flag and printed on the page:

* **estimator call**: a launch floor (a TensorRT engine's call, ``--call-floor-ms``) plus its FLOPs
  (``s3flow.model.flops``: the query and key terms apart, a call reading a kept cache attending over it too) at
  ``--efficiency`` of the GPU's dense fp16 rate (``--peak-tflops``); with ``--measured``, the floor and the rate
  fitted to the GPU check's CUDA-graph figures (``scaling`` section) instead;
* **encoder call** and **vocoder** (``token2wav``, on the same device, after each answer): their FLOPs per token and
  per mel frame counted on the full-size modules (``torch.utils.flop_counter``), the same floor and rate;
* **host**: the solver's Python per Euler step and per chunk, and a chunk's transit (client, gRPC, admission, the
  ensemble), as measured on this host's served path (results/overhead.md, ``--step-host-ms``, ``--chunk-host-ms``,
  ``--transit-ms``): a GPU host's faster cores would do better;
* **memory**: each stream's state, and with ``keep_solved`` its kept caches (fp16 on the GPU), against the GPU's.

Loads: N streams of held-out sentences (3-6 s, their own prompts, the client's chunk schedule) started evenly over
2 s, for whole-chunk FIFO (``--max-batch-size`` chunks an execute), least slack (``scheduling deadline``,
every chunk at full steps) and least slack with fewer steps, one solver instance (the GPU layout). Per cell: the
streams whose player (0.3 s buffer) ran dry, first audio p50 / p99, and the solver's busy share of the run, in GPU
calls and in the host's Python (which of the two bounds it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from s3flow_contract.tensors import SAMPLES_PER_FRAME
from s3flow.engine.capacity import Costs
from s3flow.engine.scheduler import DeadlineSettings
from s3flow.engine.settings import SolverSettings
from s3flow.model.estimator import EstimatorConfig
from s3flow.model.flops import estimator_flops
from s3flow.model.prefix_cache import CacheShape
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow_tools.bench.report import machine
from s3flow_tools.measure.corpus import utterances
from s3flow_tools.measure.qos import BUFFER_S, starts
from s3flow_tools.sim.streams import run_streams
from s3flow_tools.sim.virtual_server import HostCosts, Pricing, VirtualServer

ROOT = Path(__file__).resolve().parents[3]
#: the policies projected: (label, scheduling, min_steps)
POLICIES = (("FIFO", "fifo", 0), ("least slack", "deadline", 0), ("least slack, fewer steps", "deadline", 4))
GUIDED_STREAMS = (1, 16, 64, 128, 256)
MEANFLOW_STREAMS = (1, 16, 64, 128, 256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU as the projection prices it."""
    name: str = "H200"
    peak_tflops: float = 989.0          # dense fp16 / bf16 tensor-core rate
    efficiency: float = 0.3             # the share of it a call's matrix products reach
    call_floor_s: float = 1.0e-3        # a TensorRT engine call's launch floor
    memory_gb: float = 141.0

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency


def counted_flops(module, *inputs) -> int:
    """The matrix-product FLOPs of one forward (``torch.utils.flop_counter``, as ``s3flow.model.flops`` counts)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        module(*inputs)
    return int(counter.get_total_flops())


def encoder_flops_per_token() -> float:
    """The full-size flow encoder's FLOPs per token (slope between 50 and 250 tokens; attention makes it grow a
    little with the length: the slope is the longer calls')."""
    import torch

    from s3flow.model.encoder import EncoderConfig, FlowEncoder, random_encoder_inputs
    torch.manual_seed(0)
    enc = FlowEncoder(EncoderConfig.full()).eval()
    counts = {}
    for n in (50, 250):
        tokens, _, emb = random_encoder_inputs(enc.config, 1, n)
        counts[n] = counted_flops(enc, tokens, torch.tensor([n]), emb)
    return (counts[250] - counts[50]) / 200


def vocoder_flops_per_frame() -> float:
    """The full-size HiFT vocoder's FLOPs per mel frame (one 2 s call)."""
    import torch

    from s3flow.model.vocoder import HiFTGenerator, VocoderConfig
    torch.manual_seed(0)
    hift = HiFTGenerator(VocoderConfig.full()).folded()
    frames = 100
    harmonics = torch.randn(1, hift.config.nb_harmonics + 1, SAMPLES_PER_FRAME * frames)
    return counted_flops(hift, torch.randn(1, 80, frames), harmonics) / frames


def measured_gpu(path: Path, gpu: Gpu) -> Gpu:
    """The floor and rate fitted to the GPU check's CUDA-graph figures (ms against the call's FLOPs)."""
    data = json.loads(Path(path).read_text()).get("data", {}).get("scaling", {}).get("graph_bf16_ms", {})
    if len(data) < 2:
        raise SystemExit(f"{path} holds no scaling figures (graph_bf16_ms): run `python3 scripts/gpu_check.py "
                         f"--sections scaling` on a GPU first")
    config = EstimatorConfig.full()
    points = []
    for key, ms in data.items():
        rows, frames = (int(part[1:]) for part in key.split("/"))
        points.append((estimator_flops(config, rows, frames).total, ms / 1e3))
    slope, floor = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
    rate = 1.0 / float(slope)   # FLOP per second
    return dataclasses.replace(gpu, call_floor_s=max(float(floor), 0.0), efficiency=rate / (gpu.peak_tflops * 1e12))


def pricing(gpu: Gpu, enc_per_token: float, voc_per_frame: float, vocoder: bool) -> Pricing:
    config = EstimatorConfig.full()
    return Pricing(
        estimator=lambda rows, frames, key_frames: gpu.call_floor_s + estimator_flops(
            config, rows, frames, key_frames if key_frames != frames else None).total / gpu.flops_per_s,
        encoder=lambda tokens: gpu.call_floor_s + enc_per_token * tokens / gpu.flops_per_s,
        vocoder=(lambda frames: gpu.call_floor_s + voc_per_frame * frames / gpu.flops_per_s) if vocoder else None)


def linear_costs(price: Pricing) -> Costs:
    """What the server would measure of those calls: the linear fit the step loop decides by (a part per call,
    per row-frame solved and per cached key row-frame read)."""
    grid = [(r, f, p) for r in (2, 16, 64, 256) for f in (64, 200, 400) for p in (0, 50, 150)]
    x = np.array([[1.0, r * f, r * p] for r, f, p in grid])
    y = np.array([price.estimator(r, f, f + p) for r, f, p in grid])
    (fixed, slope, per_key), *_ = np.linalg.lstsq(x, y, rcond=None)
    return Costs(est_fixed=max(float(fixed), 0.0), est_per_unit=float(slope), enc_fixed=price.encoder(0),
                 enc_per_unit=price.encoder(1) - price.encoder(0), max_batch=256,
                 est_per_key=min(max(float(per_key), 0.0), float(slope)))


def settings(scheduling: str, min_steps: int, meanflow: bool, args) -> RepositorySettings:
    solver = SolverSettings(deadlines=DeadlineSettings(max_step_rows=args.max_step_rows,
                                                       max_step_row_frames=400 * args.max_step_rows,
                                                       min_steps=min_steps if not meanflow else 0))
    solver = solver.replace(keep_solved=args.keep_solved,
                            max_live_sequences=max(2048, solver.sequences.max_live_sequences))
    return RepositorySettings(target="gpu", solver=solver, scheduling=scheduling,
                              batching=Batching(max_batch_size=args.max_batch_size, max_candidate_sequences=4096))


def project(n: int, policy: tuple, meanflow: bool, price: Pricing, costs: Costs, host: HostCosts, args) -> dict:
    label, scheduling, min_steps = policy
    s = settings(scheduling, min_steps, meanflow, args)
    utts = [dataclasses.replace(u, n_timesteps=2 if meanflow else 10) for u in utterances(n)]
    server = VirtualServer(s, costs, host, n_feats=80, meanflow=meanflow, pricing=price)
    t0 = time.perf_counter()
    results = run_streams(server, utts, starts(n, 2.0), rules=s.solver.rules)
    bad = [r.error for r in results if r.error]
    if bad:
        raise SystemExit(f"{label}, {n} streams: {bad[0]}")
    first = [r.first_chunk_s for r in results]
    wall = max(r.wall_s + at for r, at in zip(results, starts(n, 2.0)))
    busy = sum(i.busy_s for i in server.instances) / wall
    device = sum(i.device_s for i in server.instances) / wall
    return {"n": n, "policy": label, "dry": sum(r.playback_stalls(BUFFER_S)[0] > 0 for r in results),
            "p50": float(np.percentile(first, 50)), "p99": float(np.percentile(first, 99)), "busy": busy,
            "device": device,
            "real_s": time.perf_counter() - t0}


def stream_bytes(keep_solved: int, meanflow: bool, context_frames: int = 100, prompt_frames: int = 50) -> float:
    """A stream's kept caches on the GPU (fp16): per frame per Euler step and guidance half, each attention layer's
    keys and values (``s3flow.model.prefix_cache``); 0 without keep_solved (its state is tens of KB)."""
    if not keep_solved:
        return 0.0
    shape = CacheShape.of(EstimatorConfig.full())
    per_frame = 2 * shape.layers * shape.heads * shape.head_dim * 2   # keys + values, 2 bytes each
    frames = prompt_frames + (context_frames if keep_solved == 2 else 0)
    return per_frame * frames * (2 if meanflow else 10) * (1 if meanflow else 2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = Gpu()
    p.add_argument("--peak-tflops", type=float, default=g.peak_tflops)
    p.add_argument("--efficiency", type=float, default=g.efficiency)
    p.add_argument("--call-floor-ms", type=float, default=1e3 * g.call_floor_s)
    p.add_argument("--memory-gb", type=float, default=g.memory_gb)
    p.add_argument("--measured", type=Path, help="the GPU check's json: its CUDA-graph figures replace the floor "
                                                 "and the efficiency")
    p.add_argument("--step-host-ms", type=float, default=1.5, help="the solver's Python per Euler step (%(default)s)")
    p.add_argument("--chunk-host-ms", type=float, default=5.2, help="... per chunk (%(default)s)")
    p.add_argument("--transit-ms", type=float, default=2.6, help="a chunk's way in and out (%(default)s)")
    p.add_argument("--lean-host-ms", default="0.3,1.0", help="the second host scenario: the solver's Python per "
                   "step and per chunk (ms) on the lean served path (issue 49's aim; stated, not measured)")
    p.add_argument("--max-batch-size", type=int, default=64, help="FIFO: chunks an execute (%(default)s)")
    p.add_argument("--max-step-rows", type=int, default=256, help="least slack: rows a step (%(default)s)")
    p.add_argument("--keep-solved", type=int, default=0)
    p.add_argument("--model", default="token2wav", choices=("token2mel", "token2wav"))
    p.add_argument("--guided", default=",".join(map(str, GUIDED_STREAMS)))
    p.add_argument("--meanflow", default=",".join(map(str, MEANFLOW_STREAMS)))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "projection.md")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    gpu = Gpu(peak_tflops=args.peak_tflops, efficiency=args.efficiency, call_floor_s=args.call_floor_ms / 1e3,
              memory_gb=args.memory_gb)
    if args.measured:
        gpu = measured_gpu(args.measured, gpu)
    enc, voc = encoder_flops_per_token(), vocoder_flops_per_frame()
    price = pricing(gpu, enc, voc, vocoder=args.model == "token2wav")
    costs = linear_costs(price)
    lean_step, lean_chunk = (float(x) / 1e3 for x in args.lean_host_ms.split(","))
    hosts = {"as measured here": HostCosts(chunk_s=args.chunk_host_ms / 1e3, step_s=args.step_host_ms / 1e3,
                                           transit_s=args.transit_ms / 1e3),
             "lean": HostCosts(chunk_s=lean_chunk, step_s=lean_step, transit_s=args.transit_ms / 1e3)}
    cells = []
    for host_name, host in hosts.items():
        for meanflow, counts in ((False, args.guided), (True, args.meanflow)):
            for policy in (POLICIES if not meanflow else POLICIES[:2]):   # (meanflow: 2 steps, none fewer)
                for n in [int(x) for x in counts.split(",") if x]:
                    cell = project(n, policy, meanflow, price, costs, host, args)
                    cell["kind"] = "meanflow, 2 steps" if meanflow else "guided, 10 steps"
                    cell["host"] = host_name
                    cells.append(cell)
                    print(f"{host_name}: {cell['kind']} {cell['policy']} {n}: dry {cell['dry']}, first p50/p99 "
                          f"{1e3 * cell['p50']:.0f}/{1e3 * cell['p99']:.0f} ms, busy {cell['device']:.2f} GPU + "
                          f"{cell['busy'] - cell['device']:.2f} host ({cell['real_s']:.0f} s)", flush=True)
    args.out.write_text(report(cells, gpu, enc, voc, costs, hosts, args, time.perf_counter() - t0))
    print(f"wrote {args.out}")
    return 0


def report(cells, gpu: Gpu, enc: float, voc: float, costs: Costs, hosts: dict, args, took_s: float) -> str:
    host, lean = hosts["as measured here"], hosts["lean"]
    measured = f" --measured {args.measured}" if args.measured else ""
    floor_from = ("the GPU check (fit)" if args.measured else
                  "stated: a TensorRT engine call (`--call-floor-ms`); eager torch: 27 ms (results/gpu_check.md)")
    config = EstimatorConfig.full()
    one = lambda rows, frames: 1e3 * (gpu.call_floor_s + estimator_flops(config, rows, frames).total / gpu.flops_per_s)
    lines = [
        f"# What one {gpu.name} would carry (projected)", "",
        f"Made by `python -m s3flow_tools.measure.projection{measured}` "
        f"({took_s / 60:.1f} min on {', '.join(f'{k} {v}' for k, v in machine().items())}): the server's own solver "
        f"code on a virtual clock (`s3flow_tools.sim`, checked against the real server in results/qos.md) over the "
        f"full-size model priced for one {gpu.name}. `{args.model}`; held-out sentences of 3-6 s with their own "
        f"prompts, the client's chunk schedule, N streams started evenly over 2 s; one solver instance; FIFO "
        f"{args.max_batch_size} chunks an execute, least slack {args.max_step_rows} rows a step; keep_solved "
        f"{args.keep_solved}.", "",
        "## Assumptions", "",
        "| what | value | from |", "| --- | --- | --- |",
        f"| dense fp16 rate | {gpu.peak_tflops:g} TFLOP/s x {gpu.efficiency:.2f} = "
        f"{gpu.flops_per_s / 1e12:.0f} TFLOP/s "
        f"| {'the GPU check (fit)' if args.measured else 'stated (`--efficiency`)'} |",
        f"| a call's launch floor | {1e3 * gpu.call_floor_s:.2f} ms | "
        f"{floor_from} |",
        f"| estimator call, 2 rows x 100 / 300 frames; 64 rows x 300 | {one(2, 100):.2f} / {one(2, 300):.2f}; "
        f"{one(64, 300):.1f} ms | floor + FLOPs (`s3flow.model.flops`) |",
        f"| encoder | {enc / 1e9:.3f} GFLOP a token | counted on the full-size module |",
        f"| vocoder | {voc / 1e9:.3f} GFLOP a mel frame | counted on the full-size HiFT"
        f"{'' if args.model == 'token2wav' else ' (not used: token2mel)'} |",
        f"| host: the solver's Python | {1e3 * host.step_s:.1f} ms an Euler step, {1e3 * host.chunk_s:.1f} ms a chunk "
        f"| this host's served path (results/overhead.md) |",
        f"| host, lean | {1e3 * lean.step_s:.1f} ms an Euler step, {1e3 * lean.chunk_s:.1f} ms a chunk | stated: the "
        f"lean served path's aim (issue 49: tensors by DLPack, one hop per answer), `--lean-host-ms` |",
        f"| a chunk's transit | {1e3 * host.transit_s:.1f} ms | this host: client, gRPC, admission, ensemble |",
        f"| the step loop's cost model | {1e3 * costs.est_fixed:.2f} ms + {1e9 * costs.est_per_unit:.2f} ns a "
        f"row-frame + {1e9 * costs.est_per_key:.2f} ns a cached key row-frame "
        f"| the linear fit a server would measure of those calls |",
        "",
        "## Streams", "",
        "| host | model | policy | streams | ran dry (0.3 s buffer) | first audio p50 / p99 (ms) | solver busy: GPU "
        "calls + host Python, share of the run |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for c in cells:
        lines.append(f"| {c['host']} | {c['kind']} | {c['policy']} | {c['n']} | {c['dry']} / {c['n']} | "
                     f"{1e3 * c['p50']:.0f} / {1e3 * c['p99']:.0f} | {c['device']:.2f} + "
                     f"{c['busy'] - c['device']:.2f} |")
    lines += ["", "## Against the goal", ""]
    for (name, kind, goal) in [(h, k, g) for h in hosts for k, g in (("guided, 10 steps", 128),
                                                                      ("meanflow, 2 steps", 512))]:
        for policy in [p[0] for p in POLICIES if any(c["policy"] == p[0] and c["kind"] == kind for c in cells)]:
            mine = [c for c in cells if c["kind"] == kind and c["policy"] == policy and c["host"] == name]
            ok = [c["n"] for c in mine if c["dry"] == 0 and c["p99"] <= 0.3]
            short = [c for c in mine if c["n"] not in ok]
            bound = ""
            if short:
                c = min(short, key=lambda c: c["n"])
                host = c["busy"] - c["device"]
                bound = (f"; at {c['n']} the solver is busy {c['busy']:.2f} of the run, {c['device']:.2f} in GPU calls "
                         f"and {host:.2f} in the host's Python: bound by "
                         f"{'host time' if host > c['device'] else 'compute'}")
            lines.append(f"- host {name}, {kind}, {policy}: the most streams at 0 stalls with first audio p99 "
                         f"<= 300 ms: "
                         f"**{max(ok) if ok else 0}** of those tried (goal >= {goal}){bound}.")
    alone = [c for c in cells if c["n"] == 1 and c["host"] == "as measured here"]
    if alone:
        firsts = ", ".join(f"{1e3 * c['p50']:.0f} ms ({c['kind']}, {c['policy']})" for c in alone)
        lines.append(f"- One stream's first audio: {firsts} (goal <= 50 ms).")
    per_stream = stream_bytes(args.keep_solved, False)
    lines += ["", "## Memory", "",
              f"A stream's state is tens of KB (its prompt, the last 100 frames' mel and tokens); a step's activations "
              f"are bounded by the step budget. With keep_solved 2 a stream keeps "
              f"{stream_bytes(2, False) / 1e6:.0f} MB (guided) / {stream_bytes(2, True) / 1e6:.0f} MB (meanflow) of "
              f"caches in fp16: {int(gpu.memory_gb * 1e9 * 0.9 / stream_bytes(2, False))} guided streams fill 90 % of "
              f"{gpu.memory_gb:g} GB. This projection: keep_solved {args.keep_solved}"
              f"{f', {per_stream / 1e6:.0f} MB a stream' if per_stream else ''}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
