"""Failover drill on real tritonservers: what a kill or a drain of a server mid-stream costs its clients.

Two servers (A, B) on one seeded small repository, on 127.0.0.1. Eight utterances stream to A with B as
the client's second address; after 12 of their chunks have been answered, A is disturbed:

* ``SIGKILL``: A and its stubs are killed; the client resumes every utterance on B;
* ``drain 60 s``: SIGTERM to A's drain supervisor; the utterances in flight finish on A, a ninth utterance
  started during the drain is refused by A and served by B;
* ``drain 1 s``: the same with a deadline too short for them: those still open when A stops resume on B.

Each run is compared with an undisturbed run of the same utterances on B (same seeds): every utterance must
complete with every frame once and equal within the client's replay tolerance. Writes results/failover.md.

Example::

    .venv/bin/python -m s3flow_tools.measure.failover            # about 2 minutes on 2 cores
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]

from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.engine.settings import SolverSettings
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance, demo_utterances
from s3flow_tools.measure.command import command

N, AFTER_CHUNKS = 8, 12


def utterances() -> list:
    return demo_utterances(N, 4.0, chunk=10, steps=4, seed=60)   # 10 chunks of 10 tokens each


def disturbed_run(repo: Path, b: TritonServer, how: str, work: Path) -> dict:
    """Stream to A (B second), disturb A after AFTER_CHUNKS chunks; timings and what the client saw."""
    drain_s = {"drain 60 s": 60.0, "drain 1 s": 1.0}.get(how)
    a = TritonServer(repo, log_file=work / f"a-{how.replace(' ', '_')}.log", drain_s=drain_s)
    marks: dict = {"chunks": []}
    with a:
        def disturb():
            marks["t"] = time.perf_counter()
            if how == "SIGKILL":
                os.killpg(a.pid, signal.SIGKILL)
                return
            os.kill(a.pid, signal.SIGTERM)
            while not a.draining:
                time.sleep(0.01)
            marks["thread"] = threading.Thread(target=late_utterance, args=(a, b, marks))
            marks["thread"].start()

        count = iter(range(1, 1 << 30))

        def progress(_):
            marks["chunks"].append(time.perf_counter())
            if next(count) == AFTER_CHUNKS:
                disturb()

        t0 = time.perf_counter()
        results = StreamingClient([a.grpc_url, b.grpc_url], timeout_s=180).synthesize(utterances(), progress=progress)
        wall = time.perf_counter() - t0
        if "thread" in marks:
            marks["thread"].join(120)
        stopped = a.process.wait(120) is not None and time.perf_counter() - marks["t"]
    after = [t for t in marks["chunks"] if t > marks["t"]]
    return {"results": results, "wall": wall, "first_after": after[0] - marks["t"] if after else float("nan"),
            "done_after": marks["chunks"][-1] - marks["t"], "stopped_after": stopped, "late": marks.get("late")}


def late_utterance(a: TritonServer, b: TritonServer, marks: dict) -> None:
    u = demo_utterance(1.0, seed=70)
    u.n_timesteps = 4
    t0 = time.perf_counter()
    [r] = StreamingClient([a.grpc_url, b.grpc_url], timeout_s=60).synthesize([u])
    marks["late"] = {"first_chunk_s": time.perf_counter() - t0 - r.wall_s + r.first_chunk_s, "resumes": r.resumes}


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "failover.md")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="failover-"))
    flow = load_flow(write_random_checkpoint(work / "ckpt.safetensors", FlowConfig.small(), seed=4))
    write_repository(work / "repo", flow, RepositorySettings(solver=SolverSettings.of(max_steps=20), batching=Batching(),
                                                             ort_threads=1))
    rows = []
    with TritonServer(work / "repo", log_file=work / "b.log") as b:
        t0 = time.perf_counter()
        ref = StreamingClient(b.grpc_url, timeout_s=180).synthesize(utterances())
        ref_wall = time.perf_counter() - t0
        frames = sum(r.mel.shape[1] for r in ref)
        for how in ("SIGKILL", "drain 60 s", "drain 1 s"):
            run = disturbed_run(work / "repo", b, how, work)
            res = run["results"]
            diff = max(float(np.abs(r.mel - w.mel).max()) for r, w in zip(res, ref))
            ok = all(r.error is None and r.mel.shape == w.mel.shape for r, w in zip(res, ref)) and diff <= 1e-3
            replayed = sum(r.replayed_frames for r in res)
            late = run["late"]
            rows.append((how, ok, sum(bool(r.resumes) for r in res), diff, run["first_after"], run["done_after"],
                         run["wall"] / ref_wall, replayed / frames, run["stopped_after"],
                         f"{late['first_chunk_s'] * 1000:.0f} ms, resumed {len(late['resumes'])}x" if late else "-"))
            print(rows[-1], flush=True)
    lines = [
        "# Failover: a server killed or drained mid-stream",
        "",
        f"`python -m s3flow_tools.measure.failover`: {N} utterances of 4 s (10 chunks of 10 tokens, 4 Euler steps, "
        f"small model, "
        f"seeded random weights) stream to server A with server B as the client's second address; after "
        f"{AFTER_CHUNKS} answered chunks A is killed (SIGKILL) or drained (SIGTERM to its drain supervisor, "
        "deadline 60 s or 1 s). Compared with an undisturbed run of the same utterances on B "
        f"({ref_wall:.2f} s wall). 2-core CPU host, both servers on it.",
        "",
        "| disturbance | all complete, equal | utterances resumed | max diff vs undisturbed | first new chunk after "
        "(s) | all done after (s) | wall / undisturbed | extra compute (replayed frames / frames) | A stopped after (s) "
        "| a new utterance during the drain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for how, ok, moved, diff, first, done, ratio, extra, stopped, late in rows:
        lines.append(f"| {how} | {'yes' if ok else 'NO'} | {moved} of {N} | {diff:.2g} | {first:.2f} | {done:.2f} | "
                     f"{ratio:.2f} | {extra:.2f} | {stopped:.1f} | {late} |")
    lines += [
        "",
        "- *first new chunk after*: from the disturbance to the next chunk any utterance delivered that it had not "
        "delivered before (the time to recover); *extra compute*: the frames computed twice because resumed "
        "utterances replay their answered chunks on B (checked against what A delivered, not delivered again).",
        "- Drain with a deadline long enough: nothing moves, the utterances finish on A, A stops by itself; a new "
        "utterance is refused by A at once (`the server is draining ...; send the START to another server`) and "
        "the client starts it on B.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0 if all(r[1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
