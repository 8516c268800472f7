"""Refused STARTs hold nothing, measured: with the admission step (the default) and without it, side by side.

Examples::

    .venv/bin/python -m s3flow_tools.measure.refusals                  # -> results/refusals.md (about 2 minutes)
    .venv/bin/python -m s3flow_tools.measure.refusals --refused 64 --out /tmp/refusals.md

Two repositories of the small config on seeded random weights, the cpu target's settings (Triton keeps an idle
sequence 5 + 30 s), differing only in ``RepositorySettings.admission``. On each server, as a plain tritonclient
stream would:

1. **refusals**: ``--refused`` STARTs with a bad token, left without END, then one well-behaved utterance
   (``StreamingClient``): when did its first chunk arrive? Without admission the refused STARTs held Triton's
   sequence slots for the idle window, and with as many of them as there are slots the new utterance waited in
   Triton's backlog (34.8 s); the solver now gives back the slot of a START it refused (``slots.SlotRelease``),
   and the report says which of the two it measured;
2. **cost**: ``--utterances`` utterances streamed one at a time (the client's chunk schedule 10, 20, 40, 80,
   100 tokens, 4 Euler steps), each chunk's latency: what the admission hop adds per chunk;
3. **a busy refusal's own cost**, in process (no server; issue 48): ``--burst`` STARTs refused by capacity against
   one load of ``--held`` streams at different points of their plan, each refusal's time in ``Admission.check``,
   with the load's answers kept per question (``ServerLoad``, as served: a burst looks ahead once) and priced
   afresh for every START (as before), alternated over ``--rounds`` rounds in one run;
4. **a busy burst, served**: two more repositories, a tiny utilization target (every START refused busy while one
   stream is held), differing only in ``Batching.admission_batching``: ``--burst`` STARTs at once over one stream,
   each refusal's answer time, ``BURST_SERVERS`` servers of each way alternated.

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
from s3flow.engine.capacity import AdmissionTarget, CapacityModel
from s3flow.engine.settings import SolverSettings
from s3flow.protocol import RequestRules
from s3flow.serving.admission import Admission
from s3flow.serving.calibration import planned_start
from s3flow.serving.load import InstanceLoad, LoadBoard, ServerLoad
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow.server.metrics_reader import wait_priced
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.demo import demo_utterance
from s3flow_client.wire import infer_inputs
from s3flow_tools.bench.repos import small_repository
from s3flow_tools.bench.report import log, machine, markdown
from s3flow_tools.measure.command import command

ROOT = Path(__file__).resolve().parents[3]
#: the served busy burst: servers of each way (alternated) and bursts on each
BURST_SERVERS, BURSTS_PER_SERVER = 2, 3


def refused_then_first_chunk(server, refused: int) -> tuple[float, float]:
    """(seconds to answer the refused STARTs, seconds until a new utterance's first chunk after them)."""
    u = demo_utterance(1.0, seed=1)
    bad = request_arrays(np.array([1, 9999]), start=True, prompt_tokens=u.prompt_tokens, prompt_mel=u.prompt_mel,
                         speaker_embedding=u.speaker_embedding)
    events = queue.Queue()
    client = server.client()
    # a deadline: the half-close at the end waits for the server to end the stream
    client.start_stream(callback=lambda result, error: events.put((result, error)), stream_timeout=300)
    t0 = time.perf_counter()
    for k in range(refused):
        client.async_stream_infer("token2mel", infer_inputs(bad), sequence_id=10_000_000 + k, sequence_start=True)
    answers = [events.get(timeout=120) for _ in range(refused)]
    answered = time.perf_counter() - t0
    client.stop_stream()   # every answer in: half-close (s3flow_client.channel.ServerStream.close says why)
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


class Afresh:
    """The load files read as a new ``ServerLoad`` every time: nothing it prices is kept between STARTs."""

    def __init__(self, files: LoadBoard):
        self.files = files

    def read(self, max_age_s: float = 0.0) -> ServerLoad:
        return ServerLoad(self.files.read(max_age_s).reports)


def refusal_cost(folder: Path, held: int, burst: int, rounds: int) -> dict:
    """Seconds per capacity refusal in ``Admission.check`` (section 3 of the module docstring): {"kept": [...],
    "afresh": [...]}, every refusal of every round."""
    plan, steps, rows = planned_start(SolverSettings(), 80, False)
    model = CapacityModel(max_batch=8)
    for batch, seconds in ((1, 0.004), (2, 0.006), (4, 0.010), (8, 0.018)):   # a small CPU host's calls, roughly
        model.estimator_timed(2 * batch, 150, seconds)
    files = LoadBoard(folder)
    frames = plan.expected_frames
    InstanceLoad(files, "cfm_solver_0", "solver", model, plan, steps, rows, cap=64).publish(
        {c: plan.prefix(frames * c / held) for c in range(1, held + 1)})
    u = demo_utterance(1.0, seed=1)
    start = request_arrays(u.speech_tokens[:10], start=True, prompt_tokens=u.prompt_tokens,
                           prompt_mel=u.prompt_mel, speaker_embedding=u.speaker_embedding)
    out, said = {"kept": [], "afresh": []}, {"kept": [], "afresh": []}
    for _ in range(rounds):
        for way, load in (("kept", files), ("afresh", Afresh(files))):
            admission = Admission(RequestRules(), 80, load=load, target=AdmissionTarget(utilization_target=1e-3))
            for k in range(burst):
                t0 = time.perf_counter()
                refusal = admission.check(1_000 + k, True, False, start)
                out[way].append(time.perf_counter() - t0)
                if refusal is None or refusal.reason != "capacity":
                    raise SystemExit(f"START {k} was not refused by capacity: {refusal}")
                said[way].append(refusal.error)
    if said["kept"] != said["afresh"]:
        raise SystemExit("the load's kept answers refused otherwise than priced afresh")
    return out


def busy_burst(server, burst: int) -> list[float]:
    """One stream held (a START straight to ``cfm_solver``, so the repository's tiny target refuses every START
    busy at admission), then ``burst`` STARTs sent at once over one plain tritonclient stream: each refusal's answer
    time from the first send (seconds)."""
    import tritonclient.grpc as grpcclient

    u = demo_utterance(1.0, seed=3)
    start = infer_inputs(request_arrays(u.speech_tokens[:10], start=True, prompt_tokens=u.prompt_tokens,
                                        prompt_mel=u.prompt_mel, speaker_embedding=u.speaker_embedding))
    held = server.client()
    held.infer("cfm_solver", start, sequence_id=5, sequence_start=True)
    held.close()
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((time.monotonic(), error)))
    try:
        t0 = time.monotonic()
        for i in range(burst):
            client.async_stream_infer("token2mel", start, request_id=str(i), sequence_id=100 + i, sequence_start=True)
        answers = [events.get(timeout=120) for _ in range(burst)]
    finally:
        client.stop_stream()
        client.close()
    if not all(error is not None and "busy" in str(error).lower() for _, error in answers):
        raise SystemExit("a START of the burst was not refused busy")
    return [t - t0 for t, _ in answers]


def held_slots_note(refused: int, rows: list) -> str:
    """What the first table says, by its own figures: (admission, answered in, next first chunk after) rows."""
    (_, on_answered, on_first), (_, off_answered, off_first) = rows
    if off_first >= 2.0:
        return (f"Without admission every refused START holds one of Triton's sequence slots until its idle window "
                f"passes (35 s here); with as many of them as there are slots ({refused}) the new utterance waits "
                f"in Triton's backlog. With admission the refusal happens before the sequence batcher and nothing "
                f"is held.")
    return (f"Without admission the solver refuses each START itself and then gives its slot back to Triton (a "
            f"START it refused is a drop, `failed START`, whose slot it frees by an empty END, "
            f"`s3flow.serving.triton_models.slots`), so the new utterance waited {off_first:.2f} s, not Triton's "
            f"idle window (35 s here; 34.8 s before that release). With admission the refusals were answered in "
            f"{on_answered:.2f} s against {off_answered:.2f} s and never reached the sequence batcher.")


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--refused", type=int, default=256, help="refused STARTs left open (default: %(default)s)")
    p.add_argument("--utterances", type=int, default=12, help="utterances for the per-chunk cost (default: %(default)s)")
    p.add_argument("--held", type=int, default=8, help="streams held for the refusal cost (default: %(default)s)")
    p.add_argument("--burst", type=int, default=100, help="STARTs refused in a burst (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each way, alternated (default: %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "refusals.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="refusals-"))
    cost = refusal_cost(work / "load", args.held, args.burst, args.rounds)
    ms = {way: np.array(v) * 1000 for way, v in cost.items()}
    log(f"refusal in process: kept {np.median(ms['kept']):.3f} ms, afresh {np.median(ms['afresh']):.3f} ms (median)")
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
    burst = {True: [], False: []}   # admission_batching -> per burst (p50, p99) of the refusals' answer times
    for k in range(BURST_SERVERS):
        for batching in ((True, False) if k % 2 == 0 else (False, True)):
            name = f"burst-{k}-{'batched' if batching else 'single'}"
            repo = small_repository(work / name, RepositorySettings(
                solver=SolverSettings.of(max_steps=20, utilization_target=1e-3), ort_threads=1,
                batching=Batching(admission_batching=batching)), seed=5)
            with TritonServer(repo, log_file=work / f"{name}.log") as server:
                wait_priced(f"127.0.0.1:{server.metrics_port}")
                for _ in range(BURSTS_PER_SERVER):
                    t = np.array(busy_burst(server, args.burst)) * 1000
                    burst[batching].append((np.percentile(t, 50), np.percentile(t, 99)))
            log(f"busy burst, admission batching {batching}: p99 {burst[batching][-1][1]:.0f} ms")
    on, off = (np.median(lat[True]) * 1000, np.median(lat[False]) * 1000)
    info = machine()
    lines = ["# Refused STARTs hold nothing: the admission step, measured", "",
             f"Written by `python -m s3flow_tools.measure.refusals` ({time.strftime('%Y-%m-%d')}); the small config "
             f"on seeded "
             f"random weights, the cpu target's settings (idle timeout 5 s, Triton's grace 30 s), one server at a time "
             f"on {info.get('cpu')} ({info.get('cores')} cores).", "",
             f"## {args.refused} STARTs refused for a bad token, left without END, then one new utterance", "",
             markdown(["ensembles", "the refused STARTs answered in", "the new utterance's first chunk after"],
                      [["with admission (default)" if a else "straight to cfm_solver (no admission step)", f"{x:.2f} s",
                        f"{y:.2f} s"] for a, x, y in rows]), "",
             held_slots_note(args.refused, rows), "",
             f"## What the admission step costs per chunk ({args.utterances} utterances of 3 s, one at a time, "
             f"4 Euler steps, {len(lat[True])} chunks each way)", "",
             markdown(["ensembles", "chunk latency p50", "p90"],
                      [["with admission", f"{on:.1f} ms", f"{np.percentile(lat[True], 90) * 1000:.1f} ms"],
                       ["straight to cfm_solver", f"{off:.1f} ms", f"{np.percentile(lat[False], 90) * 1000:.1f} ms"]]),
             "", f"Median difference: {on - off:+.1f} ms per chunk ({(on - off) / off * 100:+.1f} %).", "",
             f"## A busy refusal's own cost in admission ({args.burst} STARTs refused by capacity against one load "
             f"of {args.held} streams, in process, {args.rounds} rounds of each way alternated)", "",
             markdown(["the load's answers", "per refusal p50", "p99", "a burst (sum, median round)"],
                      [[label, f"{np.median(ms[way]):.3f} ms", f"{np.percentile(ms[way], 99):.3f} ms",
                        f"{np.median(ms[way].reshape(args.rounds, args.burst).sum(axis=1)):.1f} ms"]
                       for way, label in (("kept", "kept per question (as served)"),
                                          ("afresh", "priced afresh for every START (before)"))]), "",
             f"Ratio of the medians: {np.median(ms['afresh']) / np.median(ms['kept']):.1f}x. A refusal's "
             "`retry_after` looks ahead along every held stream's plan; a burst refused against one unchanged load "
             "asks the same question, so it is answered once (`ServerLoad`). Served, under the admitted streams' "
             "load, the refusal's answer time is in results/qos.md's admission tables.", "",
             f"## A burst refused busy, served: admission's requests one per execute or the queued ones in one "
             f"({args.burst} STARTs at once over one stream beside one held stream, {BURST_SERVERS} servers of each "
             f"way alternated, {BURSTS_PER_SERVER} bursts each)", "",
             markdown(["admission", "a refusal's answer time p50 (median burst)", "p99 (median burst)",
                       "p99 (worst burst)"],
                      [[label, f"{np.median([b[0] for b in burst[way]]):.0f} ms",
                        f"{np.median([b[1] for b in burst[way]]):.0f} ms", f"{max(b[1] for b in burst[way]):.0f} ms"]
                       for way, label in ((True, "the queued requests in one execute (`--admission-batching`)"),
                                          (False, "one request per execute (shipped)"))]), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())
    return 0 if rows[0][2] < 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
