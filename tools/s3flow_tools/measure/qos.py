"""Streams under load, FIFO vs the step-level deadline scheduler, side by side in one run (issue 33).

Example::

    .venv/bin/python -m s3flow_tools.measure.qos                        # -> results/qos.md
    .venv/bin/python -m s3flow_tools.measure.qos --loads 0.5,0.8 --runs 1 --out /tmp/qos.md

Repositories of the trained small model (``checkpoints/trained``: teacher, 10 guided steps, and its vocoder), the
repository defaults but for the scheduling (``--modes``: ``fifo``; ``deadline``, every chunk at its full steps,
``--min-steps 0``; ``fewer``, the deadline scheduler giving late chunks fewer steps, ``--min-steps`` its default;
``kept``, FIFO with every frame solved once, ``--keep-solved 2``),
served one after the other on this host (``token2mel`` by default), admission's capacity check off (every load is
offered whole: what each scheduling does with more than it can carry; the admission section is
``s3flow_tools.measure.admission``'s); its step stays, as it marks when each START arrived (the simulator's streams
start then).
On each server:

1. **C**, the saturation throughput: ``--at-once`` streams of held-out sentences started together, seconds of
   audio per second of wall time;
2. **loads** of k C (C being FIFO's, measured in this run), round(k C) streams of held-out sentences (3-6 s,
   their own prompts), started evenly over 2 s or all at once, each a plain ``StreamingClient`` of its own with
   the client's chunk schedule; per stream its first audio and whether a real-time player, started at its first
   audio with no buffer or with 0.3 s, runs dry (``StreamResult.playback_stalls``), the server's
   ``s3flow_stream_underruns_total`` and ``s3flow_fewer_steps_chunks_total``, and the streams' ESTOI against the
   recordings (their mel vocoded by the trained vocoder, after the server has stopped).

Beside each cell, the simulator (``s3flow_tools.sim``: the server's own solver code on a virtual clock) on the same
load, the same sentences started when the server's streams sent their START (measured: "at once" spreads over tens
of ms on two cores, and which START finds its instance idle decides its steps), priced from the same server
(``simulate``: an instance alone by its 1-stream cells' chunk latencies, at load by the costs the instances saved
at their close); every other cell is its prediction: first answer p95, streams that ran dry and chunks given fewer
steps, and its error against the server's (``token2mel`` only: the simulator has no vocoder). Exits non-zero when
a stream fails.
"""
from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[3]

from s3flow_contract.tensors import FRAMES_PER_SECOND
from s3flow.repository import cli as build_repository
from s3flow.server.metrics_reader import metric_sum, read_metrics, wait_priced
from s3flow.server.triton_server import TritonServer
from s3flow.serving.arrivals import ArrivalMarks
from s3flow_client import StreamingClient, Utterance
from s3flow_tools.bench.report import machine
from s3flow_tools.sim.price import chunk_work, fit_alone, served_costs
from s3flow_tools.sim.streams import run_streams
from s3flow_tools.sim.virtual_server import HostCosts, Pricing, VirtualServer
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import TRAINED, held, utterances
from s3flow_tools.measure.sections import write_keeping_sections

BUFFER_S = 0.3
#: a chunk's way in and out without admission (client and gRPC, the ensemble's hops): results/overhead.md, alone
TRANSIT_S = 1.3e-3
#: the modes: their build flags (``fewer``: the deadline scheduler at its default ``min_steps``; ``kept``: FIFO with
#: every frame solved once, ``keep_solved 2``, docs/streaming.md). Each mode has the target's chunk solving beside
#: its flags: since 2026-12-06 the cpu target keeps the prompt's cache with 25 frames of context, so a chunk that
#: reads the cache keeps its full steps under ``fewer`` (only a chunk that reads none, a START, may be given fewer)
MODES = {"fifo": ["--scheduling", "fifo"], "deadline": ["--scheduling", "deadline", "--min-steps", "0"],
         "fewer": ["--scheduling", "deadline"], "kept": ["--scheduling", "fifo", "--keep-solved", "2"]}


def fewer_steps(server) -> float:
    return metric_sum(read_metrics(f"127.0.0.1:{server.metrics_port}"), "s3flow_fewer_steps_chunks_total")


def estoi(rows: list) -> None:
    """Each row's mean ESTOI against the recordings (its streams' mel vocoded by the trained vocoder)."""
    from s3flow.model.vocoder import load_vocoder
    from s3flow.runtime.vocoder import vocode
    from s3flow_training.intelligibility import intelligibility

    hift = load_vocoder(TRAINED / "vocoder.safetensors")
    for r in rows:
        r["estoi"] = float(np.mean([intelligibility(h.reference, vocode(hift, m)).estoi
                                    for h, m in zip(r.pop("held"), r.pop("mels"))]))


def streams(url: str, model: str, utts: list[Utterance], spread_s: float) -> tuple[list, float]:
    """Start one client per utterance, evenly over ``spread_s``; their results and the wall time of all. When each
    START reached the server is :func:`start_marks`' to say ("at once" is not at once on two cores: the clients'
    threads and streams open one after another, and which START finds its instance idle decides its steps)."""
    results, at = [None] * len(utts), starts(len(utts), spread_s)
    t0 = time.monotonic()

    def one(k):
        time.sleep(max(0.0, t0 + at[k] - time.monotonic()))
        [results[k]] = StreamingClient(url, model, timeout_s=300).synthesize([utts[k]])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(utts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.monotonic() - t0


def start_marks(server_pid: int, corr_ids: list[int]) -> Optional[list[float]]:
    """When the server's admission let each of ``corr_ids``' STARTs through (wall clock); None unless it marked
    every one (no admission step, an id it never saw)."""
    folder = ArrivalMarks.default_folder("starts", server_pid)
    if not folder.is_dir():
        return None
    marks = ArrivalMarks(folder)
    try:
        times = [marks.peek(c) for c in corr_ids]
    finally:
        marks.close()
    return None if any(t is None for t in times) else times


def began_at(server_pid: int, results: list) -> list[float]:
    """When each stream's START reached the server, in seconds after the first (:func:`start_marks`); all at 0
    (said so) where the server did not mark every one."""
    marked = start_marks(server_pid, [r.corr_id if r is not None else 0 for r in results])
    if marked is None:
        print("  (the server did not mark every START: the simulator starts these streams at once)", flush=True)
        return [0.0] * len(results)
    return [t - min(marked) for t in marked]


def starts(n: int, spread_s: float) -> list[float]:
    """When each of ``n`` streams starts: evenly over ``spread_s`` (0: all at once), as ``streams`` starts them."""
    return [spread_s * k / max(1, n - 1) if n > 1 else 0.0 for k in range(n)]


def simulate(rows: list, mode: str, settings, saved, at_once: int, c_server: float) -> dict:
    """The simulator beside each of ``mode``'s rows (``r["sim"]``: first answers, streams that ran dry and chunks
    given fewer steps, on the same sentences started when the server's sent their START, ``r["began"]``). An
    instance working alone is priced by the 1-stream rows' chunk latencies (``fit_alone``: a part per estimator call
    and a part per row-frame; the encoder as ``saved``; the transit ``TRANSIT_S``), one working beside the other at
    load by ``saved``, what the instances measured (saved at their close). What it was run with."""
    mine = [r for r in rows if r["mode"] == mode]
    delay = settings.batching.max_queue_delay_us * 1e-6
    points = [(work, latency) for r in mine if r["n"] == 1
              for work, latency in zip(chunk_work(settings, utterances(1, offset=r["offset"])[0]), r["latencies"][0])]
    alone = fit_alone(points, saved, delay, TRANSIT_S) if points else saved

    def run(r):
        server = VirtualServer(settings, saved, HostCosts(transit_s=TRANSIT_S), n_feats=80,
                               pricing=Pricing.of(alone), loaded=Pricing.of(saved))
        spread = 0.0 if "at once" in r["label"] or r["n"] == 1 else 2.0
        at = r.get("began") or starts(r["n"], spread)   # when the server's streams began, where measured
        return run_streams(server, utterances(r["n"], offset=r["offset"]), [t - min(at) for t in at],
                           rules=settings.solver.rules), server.fewer_steps_chunks

    for r in mine:
        results, fewer = run(r)
        r["sim"] = ([x.first_chunk_s for x in results], sum(x.playback_stalls(BUFFER_S)[0] > 0 for x in results),
                    fewer)
    burst, _ = run({"label": "at once", "n": at_once, "offset": 0})
    c_sim = sum(x.mel.shape[1] for x in burst) / FRAMES_PER_SECOND / max(x.wall_s for x in burst)
    return {"alone": alone, "loaded": saved, "c": c_sim, "c_server": c_server}


def _simulated(r: dict) -> str:
    if "sim" not in r:
        return "-"
    first, dry, fewer = r["sim"]
    p95, served = np.percentile(first, 95), np.percentile(r["first"], 95)
    return f"{1000 * p95:.0f} ms ({100 * (p95 / served - 1):+.0f} %), {dry} / {r['n']}, {fewer}"


def _simulator_note(sims: dict) -> str:
    if not sims:
        return "No simulator column: it has no vocoder (`token2mel` only)."

    def costs(c) -> str:
        return (f"estimator {1e3 * c.est_fixed:.2f} ms + {1e6 * c.est_per_unit:.1f} us a row-frame + "
                f"{1e6 * c.est_per_key:.1f} us a cached key row-frame, encoder "
                f"{1e3 * c.enc_fixed:.2f} ms + {1e6 * c.enc_per_unit:.1f} us a token")

    parts = [f"`{m}`: alone {costs(s['alone'])}; at load {costs(s['loaded'])}; C {s['c']:.2f} (server "
             f"{s['c_server']:.2f})" for m, s in sims.items()]
    return ("The simulator (`s3flow_tools.sim`) was priced from this run's server: an instance working alone by the "
            "1-stream rows' chunk latencies (a part per estimator call and a part per row-frame; the encoder as the "
            "instances saved it, a chunk's transit 1.3 ms as measured in results/overhead.md), one working beside "
            "the other by the costs the instances saved at their close (what admission prices with); an execute is "
            "priced between the two by the share of the other instances busy when it begins. Every other cell is "
            "its prediction: " + "; ".join(parts) + ".")


def _simulator_check(rows: list, modes: list) -> list[str]:
    """Issue 51's check, cell by cell: the medians over a cell's runs of first answer p95 and streams that ran dry
    (0.3 s), server beside simulator; the server's own runs beside their median (how far a run of the server lands
    from the median it is judged by: a cell whose runs spread wider than the target cannot be judged by it); and
    whether the simulator orders each scheduling against FIFO as the server (a cell whose runs of the two overlap
    has no order to get right)."""
    cells: dict = {}
    for r in rows:
        if "sim" in r:
            cells.setdefault((r["label"], r["mode"]), []).append(r)
    if not cells:
        return []
    out = ["Server and simulator cell by cell (medians over the runs; error of the simulator's first answer p95; "
           "the server's runs: each run's p95, and the farthest from their median; the target: within 25 % and one "
           "stream in every cell of 4 or more streams):", "",
           "| load | scheduling | streams | first answer p95, server / simulator (ms) | error | the server's runs (ms) "
           "| ran dry (0.3 s), server / simulator | within |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    p95, judged = {}, []
    for (label, mode), runs in cells.items():
        each = sorted(float(np.percentile(r["first"], 95)) for r in runs)
        served = float(np.median(each))
        sim = float(np.median([np.percentile(r["sim"][0], 95) for r in runs]))
        dry, sim_dry = float(np.median([r["dry"] for r in runs])), float(np.median([r["sim"][1] for r in runs]))
        if runs[0]["n"] >= 4:
            p95[(label, mode)] = (each, sim)
        n = runs[0]["n"]
        spread = round(max(abs(x / served - 1) for x in each), 2)   # (as printed: a "±25 %" is within 25 %)
        ok = "-" if n < 4 else ("yes" if abs(sim / served - 1) <= 0.25 and abs(sim_dry - dry) <= 1 else "no")
        if n >= 4:
            judged.append((ok == "yes", spread <= 0.25, abs(sim / served - 1) <= spread))
        runs_ms = " ".join(f"{1000 * x:.0f}" for x in each)
        out.append(f"| {label} | {mode} | {n} | {1000 * served:.0f} / {1000 * sim:.0f} | "
                   f"{100 * (sim / served - 1):+.0f} % | {runs_ms} (±{100 * spread:.0f} %) | {dry:g} / {sim_dry:g} | "
                   f"{ok} |")
    if judged:
        wide = [j for j in judged if not j[1]]
        out += ["", f"Within the target: {sum(j[0] for j in judged)} of {len(judged)} cells of 4 or more streams. The "
                    f"server's own runs spread wider than 25 % from their median in {len(wide)} of them; of those, "
                    f"the simulator's error is within that spread in {sum(j[2] for j in wide)}."]
    order = []
    for (label, mode), (each, sim) in p95.items():
        if mode != "fifo" and (label, "fifo") in p95:
            f_each, f_sim = p95[(label, "fifo")]
            apart = max(each) < min(f_each) or min(each) > max(f_each)
            order.append((float(np.median(each)) < float(np.median(f_each))) == (sim < f_sim) if apart else None)
    if order:
        told = [o for o in order if o is not None]
        out += ["", f"Order against FIFO (first answer p95) as the server's: {sum(told)} of the {len(told)} cells of 4 "
                    f"or more streams where every run of one is below every run of the other ({len(order) - len(told)} "
                    f"of {len(order)} overlap)."]
    return out + [""]


def underruns(server) -> float:
    return metric_sum(read_metrics(f"127.0.0.1:{server.metrics_port}"), "s3flow_stream_underruns_total")


def row(label: str, mode: str, results: list, dry: float, model: str, cut: float = 0.0,
        heldout: tuple = ()) -> dict:
    bad = [r.error for r in results if r.error is not None]
    if bad:
        raise SystemExit(f"{label} {mode}: {len(bad)} streams failed: {bad[0]}")
    # token2mel answers no audio: its first answer with frames stands for the first audio
    first = [r.first_audio_s if model == "token2wav" else r.first_chunk_s for r in results]
    stalls = [r.playback_stalls(BUFFER_S) for r in results]
    return {"label": label, "mode": mode, "n": len(results), "first": first,
            "dry0": sum(r.playback_stalls(0.0)[0] > 0 for r in results), "dry": sum(s[0] > 0 for s in stalls),
            "stall_p95": float(np.percentile([s[1] for s in stalls], 95)), "underruns": dry, "cut": cut,
            "chunks": sum(len(r.chunk_frames) for r in results), "held": list(heldout),
            "latencies": [r.chunk_latencies_s for r in results],
            "mels": [r.mel for r in results]}


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--model", default="token2mel", choices=("token2mel", "token2wav"))
    p.add_argument("--loads", default="0.5,0.8,1.0", help="offered loads in units of FIFO's C (%(default)s)")
    p.add_argument("--at-once", type=int, default=16, help="streams that measure C (%(default)s)")
    p.add_argument("--runs", type=int, default=1, help="runs of each load (%(default)s)")
    p.add_argument("--modes", default="fifo,deadline,fewer", help="scheduling modes, fifo first (%(default)s)")
    p.add_argument("--at-once-loads", default="", help="loads run only at once, not spread (e.g. 1.5)")
    p.add_argument("--deadline-flags", default="", help="more build_repository flags for the deadline modes "
                   "(e.g. '--first-audio-s 0.15')")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "qos.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    loads = [float(x) for x in args.loads.split(",")]
    at_once = [float(x) for x in args.at_once_loads.split(",") if x]
    modes = args.modes.split(",")
    if modes[0] != "fifo" or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: fifo first, then any of {sorted(MODES)}; got {args.modes}")
    rows, cs, sims = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            repo = Path(tmp) / mode
            flags = ["--checkpoint", str(TRAINED / "teacher.safetensors"), "--vocoder-checkpoint",
                     str(TRAINED / "vocoder.safetensors"), "--output", str(repo), "--no-voice",
                     "--utilization-target", "0",
                     *MODES[mode], *(args.deadline_flags.split() if mode in ("deadline", "fewer") else [])]
            if build_repository.main(flags) != 0:
                raise SystemExit("building the repository failed")
            with TritonServer(repo, log_file=Path(tmp) / f"{mode}.log") as server:
                wait_priced(f"127.0.0.1:{server.metrics_port}", args.model)   # its calibration: not beside a stream
                streams(server.grpc_url, args.model, utterances(2), 0.0)   # warm the client path
                results, wall = streams(server.grpc_url, args.model, utterances(args.at_once), 0.0)
                cs[mode] = sum(r.mel.shape[1] for r in results) / FRAMES_PER_SECOND / wall
                print(f"{mode}: C = {cs[mode]:.2f} s of audio per second", flush=True)
                c = cs["fifo"]
                plan = [("1 stream", 1, 0.0)] + [(f"{k:g} C {'over 2 s' if spread else 'at once'}",
                                                  max(1, round(k * c)), spread) for k in loads for spread in (2.0, 0.0)]
                plan += [(f"{k:g} C at once", max(1, round(k * c)), 0.0) for k in at_once]
                for label, n, spread in plan:
                    for run in range(args.runs):
                        before, cut = underruns(server), fewer_steps(server)
                        results, _ = streams(server.grpc_url, args.model, utterances(n, offset=7 * run), spread)
                        began = began_at(server.pid, results)
                        rows.append(row(label, mode, results, underruns(server) - before, args.model,
                                        fewer_steps(server) - cut, held(n, offset=7 * run)))
                        rows[-1].update(offset=7 * run, began=began)
                        r = rows[-1]
                        print(f"  {label} run {run + 1}: {n} streams, first audio p95 "
                              f"{1000 * np.percentile(r['first'], 95):.0f} ms, dry {r['dry0']}/{r['dry']} of {n}",
                              flush=True)
            if args.model == "token2mel":   # the server has saved its price at its close
                sims[mode] = simulate(rows, mode, build_repository.settings_of(build_repository.parse_args(flags)),
                                      served_costs(repo), args.at_once, cs[mode])
    estoi(rows)
    lines = [
        "# Streams under load: FIFO vs the step-level deadline scheduler",
        "",
        f"Made by `python -m s3flow_tools.measure.qos` on {', '.join(f'{k} {v}' for k, v in machine().items())}: "
        f"the trained "
        f"small teacher (10 guided steps), `{args.model}`, held-out sentences of 3-6 s with their own prompts, the "
        f"client's chunk schedule, each stream its own `StreamingClient`, admission's capacity check off (its step "
        f"marks each START's arrival, where the simulator starts its streams); the servers one after the other, "
        f"{args.runs} run(s) of each load, every run reported.",
        "",
        f"Saturation throughput C ({args.at_once} streams at once), s of audio per second: **FIFO "
        f"{cs['fifo']:.2f}**" + "".join(f", {m} {cs[m]:.2f} ({cs[m] / cs['fifo']:.2f}x)" for m in modes[1:]) +
        f" (`fewer`'s is not at full steps: at saturation most chunks are late and given fewer; capacity and "
        f"admission stay at full steps). A load of k C is round(k x {cs['fifo']:.2f}) streams. Modes: `deadline` "
        f"every chunk at its full "
        f"steps (`--min-steps 0`), `fewer` late chunks given fewer (the default `--min-steps`); chunks at fewer "
        f"steps: of all the row's chunks." + (f" Deadline modes built with `{args.deadline_flags}`."
                                              if args.deadline_flags else ""),
        "",
        f"| load | scheduling | streams | first {'audio' if args.model == 'token2wav' else 'mel'} p50 / p95 (ms) | ran dry, no buffer | ran dry, {BUFFER_S} s "
        f"buffer | stall s p95 ({BUFFER_S} s) | server underruns | chunks at fewer steps | ESTOI | "
        f"simulator: first answer p95 (error), ran dry ({BUFFER_S} s), chunks at fewer steps |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['label']} | {r['mode']} | {r['n']} | {1000 * np.percentile(r['first'], 50):.0f} / "
                     f"{1000 * np.percentile(r['first'], 95):.0f} | {r['dry0']} / {r['n']} | {r['dry']} / {r['n']} | "
                     f"{r['stall_p95']:.2f} | {r['underruns']:.0f} | {r['cut']:.0f} / {r['chunks']} | "
                     f"{r['estoi']:.3f} | {_simulated(r)} |")
    lines += ["", _simulator_note(sims), ""] + _simulator_check(rows, modes)
    write_keeping_sections(args.out, lines)   # (the admission section is its driver's)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
