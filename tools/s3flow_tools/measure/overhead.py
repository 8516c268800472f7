"""The cost of a call on the served path (issue 40.1): where one chunk's time goes, from Triton's own traces.

Starts tritonserver with Triton's request tracing on for every request (``--trace-config level=TIMESTAMPS``,
``rate=1``), streams utterances through ``token2mel`` with our client (``--alone`` of them one at a time, then
``--rounds`` of ``--at-once`` at once), stops the server (the trace file is complete then) and splits each
chunk's time, from the client's send to its answer, into:

* **client and gRPC**: the client's chunk latency less the ensemble request's span in the server;
* **ensemble hops**: the ensemble's span less its steps' (Triton handing tensors from step to step);
* **admission**: the admission step's span (its queue and its Python);
* **solver queue**: ``cfm_solver``'s wait in the sequence batcher (other batches, the queue delay);
* **encoder** and **estimator calls** (BLS, traced as the solver request's children): each call's span, split
  into the callee's own compute (ONNX Runtime: input copied to output ready) and the call's **fixed part**
  (Triton's scheduling of the call, tensor copies; the span less the compute);
* **solver Python**: the solver's execute less its BLS calls' spans, before the first call (the requests read, the
  state restored), between calls (each Euler step's Python and the stub's side of each call: its IPC) and after
  the last (the snapshot's seal, the metrics, the load reports, the responses).

A batched execute (several chunks at once) is one execute: its BLS calls are traced under its first request;
each chunk of it is charged the whole execute (what it waited for), and the call counts are per execute.

Example::

    .venv/bin/python -m s3flow_tools.measure.overhead                   # -> results/overhead.md
    .venv/bin/python -m s3flow_tools.measure.overhead --alone 2 --rounds 1 --output /tmp/overhead.md
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from s3flow.engine.settings import SolverSettings
from s3flow.model.flow import FlowConfig
from s3flow.repository.settings import DEFAULT_SOLVING, Batching, RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance
from s3flow_tools.bench.report import log, machine
from s3flow_tools.bench.repos import small_repository
from s3flow_tools.measure.command import command

ROOT = Path(__file__).resolve().parents[3]
ENSEMBLE, ADMISSION, SOLVER = "token2mel", "admission", "cfm_solver"
ENCODER, ESTIMATOR = "flow_encoder", "estimator"
#: the parts of a chunk's time, in the report's order
PARTS = ("client and gRPC", "ensemble hops", "admission", "solver queue", "encoder compute", "encoder call fixed",
         "estimator compute", "estimator call fixed", "solver Python before the calls",
         "solver Python between calls", "solver Python after the calls")


# ------------------------------------------------------------------------------------------ traces
@dataclass
class Span:
    """One traced request: its model, parent and timestamps (ns, by name)."""
    id: int
    model: str = ""
    parent: int = 0
    ns: dict = field(default_factory=dict)
    children: list = field(default_factory=list)

    def between(self, a: str, b: str) -> float:
        """Seconds from timestamp ``a`` to ``b`` (0 when either is missing)."""
        if a not in self.ns or b not in self.ns:
            return 0.0
        return (self.ns[b] - self.ns[a]) / 1e9

    @property
    def span_s(self) -> float:
        return self.between("REQUEST_START", "REQUEST_END")

    @property
    def compute_s(self) -> float:
        """The model's own work: inputs copied in to outputs begun (the backend's run)."""
        return self.between("COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START")


def read_traces(path: Path) -> dict:
    """id -> Span from Triton's trace file (its entries for one id come in several records)."""
    spans: dict = {}
    for record in json.loads(path.read_text() or "[]"):
        s = spans.setdefault(record["id"], Span(record["id"]))
        if "model_name" in record:
            s.model, s.parent = record["model_name"], int(record.get("parent_id", 0) or 0)
        for t in record.get("timestamps", []):
            s.ns.setdefault(t["name"], int(t["ns"]))
    for s in spans.values():
        if s.parent in spans:
            spans[s.parent].children.append(s)
    return spans


@dataclass
class Chunk:
    """One ensemble request's parts (seconds) and its execute's BLS call counts."""
    parts: dict
    encoder_calls: int
    estimator_calls: int
    batch: int


def chunks_of(spans: dict) -> list[Chunk]:
    """Every traced ensemble request split into PARTS but the client's (NaN: :func:`measure` fills it in), in
    arrival order."""
    ensembles = sorted((s for s in spans.values() if s.model == ENSEMBLE), key=lambda s: s.ns.get("REQUEST_START", 0))
    solvers = [c for e in ensembles for c in e.children if c.model == SOLVER]
    batch_of = defaultdict(list)   # an execute's requests share its COMPUTE_START
    for s in solvers:
        batch_of[s.ns.get("COMPUTE_START")].append(s)
    out = []
    for e in ensembles:
        steps = {c.model: c for c in e.children}
        adm, solver = steps.get(ADMISSION), steps.get(SOLVER)
        if adm is None or solver is None:   # refused at admission, or not traced whole
            continue
        batch = batch_of[solver.ns.get("COMPUTE_START")]
        calls = [c for s in batch for c in s.children]
        enc = [c for c in calls if c.model == ENCODER]
        est = [c for c in calls if c.model == ESTIMATOR]
        execute = solver.between("COMPUTE_START", "COMPUTE_END")
        parts = {
            "ensemble hops": e.span_s - adm.span_s - solver.span_s,
            "admission": adm.span_s,
            "solver queue": solver.between("QUEUE_START", "COMPUTE_START"),
            "encoder compute": sum(c.compute_s for c in enc),
            "encoder call fixed": sum(c.span_s - c.compute_s for c in enc),
            "estimator compute": sum(c.compute_s for c in est),
            "estimator call fixed": sum(c.span_s - c.compute_s for c in est),
        }
        parts.update(_solver_python(solver, calls, execute))
        out.append(Chunk({"client and gRPC": float("nan"), **parts}, len(enc), len(est), len(batch)))
    return out


def _solver_python(solver: Span, calls: list, execute: float) -> dict:
    """The execute's time outside its BLS calls: before the first (the requests read, the state restored, the
    encoder's inputs), between calls (each Euler step's Python and the stub's side of each call) and after the
    last (the snapshot's seal, the metrics, the load reports, the responses)."""
    if not calls:
        return {"solver Python before the calls": execute, "solver Python between calls": 0.0,
                "solver Python after the calls": 0.0}
    calls = sorted(calls, key=lambda c: c.ns["REQUEST_START"])
    start, end = solver.ns["COMPUTE_START"], solver.ns["COMPUTE_END"]
    before = (calls[0].ns["REQUEST_START"] - start) / 1e9
    after = (end - calls[-1].ns["REQUEST_END"]) / 1e9
    return {"solver Python before the calls": before,
            "solver Python between calls": execute - before - after - sum(c.span_s for c in calls),
            "solver Python after the calls": after}


# ------------------------------------------------------------------------------------------ the run
def utterance(seed: int, seconds: float, steps: int):
    u = demo_utterance(seconds, seed=seed)
    u.n_timesteps = steps
    return u


def stream(url: str, utterances: list, latencies: list) -> None:
    """Stream ``utterances`` at once; their chunk latencies appended in the order the chunks were sent."""
    results = StreamingClient(url, timeout_s=300, max_retries=0, max_resumes=0).synthesize(utterances)
    for r in results:
        latencies.extend(r.chunk_latencies_s)


def measure(config: FlowConfig, label: str, out: Path, alone: int, rounds: int, at_once: int, seconds: float,
            steps: int, solving: dict) -> dict:
    """{scenario: [Chunk]} for one model size: ``alone`` utterances one by one, then ``rounds`` of ``at_once``;
    ``solving``: the chunk solving (``keep_solved``, ``context_frames``)."""
    settings = RepositorySettings(solver=SolverSettings.of(max_steps=20, idle_timeout_s=120.0, utilization_target=0.0,
                                                           **solving),
                                  batching=Batching(max_batch_size=8, max_queue_delay_us=2000), ort_threads=1)
    repo = small_repository(out / label, settings, config=config)
    trace = out / f"{label}-trace.json"
    found = {}
    for scenario, n, k in (("alone", alone, 1), (f"{at_once} at once", rounds, at_once)):
        args = ["--trace-config", f"triton,file={trace}", "--trace-config", "triton,log-frequency=0",
                "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1", "--trace-config", "count=-1"]
        trace.unlink(missing_ok=True)
        latencies: list = []
        with TritonServer(repo, log_file=out / f"{label}-{k}.log", extra_args=args) as server:
            stream(server.grpc_url, [utterance(90, seconds, steps)], [])   # warm: not traced apart (dropped below)
            warm = 1
            for i in range(n):
                log(f"{label}: {scenario} round {i + 1} of {n}")
                stream(server.grpc_url, [utterance(100 * i + j, seconds, steps) for j in range(k)], latencies)
        spans = read_traces(trace)
        chunks = chunks_of(spans)
        per_utterance = len(chunks) // (n * k + warm) if chunks else 0
        chunks = chunks[per_utterance * warm:]
        if k == 1:   # one at a time: the client's latencies line up with the ensemble requests in order
            for c, lat in zip(chunks, latencies):
                c.parts["client and gRPC"] = lat - sum(v for name, v in c.parts.items() if name != "client and gRPC")
        found[scenario] = chunks
    return found


# ------------------------------------------------------------------------------------------ report
def mean(values) -> float:
    values = [v for v in values if v == v]
    return statistics.fmean(values) if values else float("nan")


def table(found: dict) -> list[str]:
    names = list(found)
    lines = ["| part (ms per chunk) | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for part in PARTS:
        cells = []
        for name in names:
            chunks = found[name]
            value = mean(c.parts[part] for c in chunks) * 1000
            total = mean(sum(v for p, v in c.parts.items() if not (p == "client and gRPC" and v != v))
                         for c in chunks) * 1000
            cells.append("n/a" if value != value else f"{value:.2f} ({100 * value / total:.0f} %)")
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    lines.append("| **total** | " + " | ".join(
        f"**{mean(sum(v for v in c.parts.values() if v == v) for c in found[n]) * 1000:.2f}**" for n in names) + " |")
    lines.append("| chunks traced | " + " | ".join(str(len(found[n])) for n in names) + " |")
    lines.append("| chunks per execute (mean) | " + " | ".join(f"{mean(c.batch for c in found[n]):.2f}" for n in names)
                 + " |")
    lines.append("| estimator calls per execute | " + " | ".join(
        f"{mean(c.estimator_calls for c in found[n]):.1f}" for n in names) + " |")
    for model, key in (("estimator", "estimator"), ("encoder", "encoder")):
        cells = []
        for n in names:
            calls = [c for c in found[n] if getattr(c, f"{key}_calls")]
            per = mean(c.parts[f"{model} call fixed"] / getattr(c, f"{key}_calls") for c in calls) * 1000
            comp = mean(c.parts[f"{model} compute"] / getattr(c, f"{key}_calls") for c in calls) * 1000
            cells.append(f"{per:.2f} fixed + {comp:.2f} compute")
        lines.append(f"| one {model} call (ms) | " + " | ".join(cells) + " |")
    return lines


def write(results: dict, args, path: Path) -> None:
    m = machine()
    lines = ["# The cost of a call on the served path", "",
             f"`python -m s3flow_tools.measure.overhead --alone {args.alone} --rounds {args.rounds} --at-once "
             f"{args.at_once} --seconds {args.seconds:g} --steps {args.steps}{' --full' if args.full else ''}"
             f"{'' if args.keep_solved is None else f' --keep-solved {args.keep_solved}'}"
             f"{'' if args.context_frames is None else f' --context-frames {args.context_frames}'}` on {m.get('cpu')} ({m.get('cores')} "
             f"cores; shared, noisy). Triton's request traces (TIMESTAMPS, every request) of `token2mel` chunks on the "
             f"client's default schedule, {args.seconds:g} s utterances, {args.steps} Euler steps with guidance; a "
             "chunk of several streams at once is charged its whole execute. How each part is measured: the "
             "module docstring (`tools/s3flow_tools/measure/overhead.py`).", ""]
    for label, found in results.items():
        lines += [f"## {label}", ""] + table(found) + [""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main(argv: Optional[list] = None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--alone", type=int, default=6, help="utterances streamed one at a time (default: 6)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of --at-once streams (default: 3)")
    p.add_argument("--at-once", type=int, default=4, help="streams started together (default: 4)")
    p.add_argument("--seconds", type=float, default=3.0, help="audio per utterance (default: 3)")
    p.add_argument("--steps", type=int, default=10, help="Euler steps (default: 10, guided)")
    p.add_argument("--full", action="store_true", help="also the full-size flow (71 M estimator; slow on CPU)")
    p.add_argument("--keep-solved", type=int, default=None,
                   help="what a stream keeps of what it solved (default: the cpu target's, DEFAULT_SOLVING)")
    p.add_argument("--context-frames", type=int, default=None, help="context frames (default: the cpu target's)")
    p.add_argument("--output", type=Path, default=ROOT / "results" / "overhead.md")
    args = p.parse_args(argv)
    solving = dict(DEFAULT_SOLVING["cpu"])
    solving.update({k: v for k, v in (("keep_solved", args.keep_solved), ("context_frames", args.context_frames))
                    if v is not None})
    sizes = {"small model (FlowConfig.small)": FlowConfig.small()}
    if args.full:
        sizes["full size (FlowConfig)"] = FlowConfig()
    results, tmp = {}, Path(tempfile.mkdtemp(prefix="s3flow-overhead-"))
    try:
        for label, config in sizes.items():
            results[label] = measure(config, label.split()[0], tmp, args.alone, args.rounds, args.at_once,
                                     args.seconds, args.steps, solving)
    except Exception:
        log(f"failed: the servers' logs and traces are kept in {tmp}")
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    write(results, args, args.output)
    print(args.output.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
