"""How many streams may start at once with none running dry: the start-up ramp's bound, by chunk setting and chunk
schedule, on the simulator priced by this host's server and on the server itself (issues 48 and 50).

A stream's chunks grow (the client's default schedule: 10 tokens, then twice as many each time up to 100) and each
is sent when the previous one is answered. Its player starts ``BUFFER_S`` after the first answer, so chunk k + 1
must be made within the buffer plus the audio of the chunks before it, and it holds twice the audio of chunk k:
while it ramps up, a stream needs its frames faster than it plays them (about the growth factor, plus its prompt
and context solved again beside every small chunk). Streams that start together ramp together, so at once the
server runs short well below its throughput C, whatever admission decides: issue 48 asks for floor(0.8 C) admitted
at once and none of them stalled. This driver finds where that bound lies.

1. The trained small teacher's repository as ``make demo`` builds it (``s3flow_tools.measure.admission.build``) is
   served once: calibrated, a burst of ``--warm`` held-out sentences at once, stopped: its solver instances save
   the price they measured (fits times correction, ``s3flow.serving.saved_price``).
2. The simulator (``s3flow_tools.sim``: the solver's own code on a virtual clock) priced with it runs, for each
   chunk setting (``SETTINGS``: today's, the prompt kept with 25 frames of context, every frame solved once) and
   each client schedule (``SCHEDULES``): 16 held-out sentences at once for its C, then n = 1, 2, ... at once (3
   sets of sentences each) until some stream runs dry with a ``BUFFER_S`` buffer. The row says the largest n
   with none dry, as a share of that C.

The simulator holds neither the per-chunk Python nor the hops (issue 49's fixed cost), so its C is above the
server's (results/keep_prompt_c25.md: the server's own ratio of the two first settings); results/qos.md compares it
with the server at these loads.

3. The same server measures the bound itself for the shipped setting and schedule (admission off): its C with
   ``C_STREAMS`` held-out sentences at once, then n = 1, 2, ... at once (the same ``RUNS`` sets of sentences the
   simulator ran) up to past floor(0.8 C) and past the first count with a stream dry; every count is reported.
4. ``--by-voice``: the same again with every sentence's prompt registered as a voice (``voice_cache_mb``,
   ``s3flow.engine.voice_prompts``) and each stream started by its voice id: the voice's prompt pass made before
   (two short streams, one on each solver instance), so no chunk solves a prompt frame; and the simulator's bound
   for the same (a row of the first table).

Example::

    .venv/bin/python -m s3flow_tools.measure.at_once           # -> results/at_once.md (~2 min)
"""
from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from s3flow_contract.tensors import FRAMES_PER_SECOND
from s3flow.repository import cli as build_repository
from s3flow.server.triton_server import TritonServer
from s3flow_client.chunking import chunk_schedule
from s3flow_tools.bench.report import machine
from s3flow_tools.bench.voices import held_voice, voice_encoder_flags
from s3flow_tools.measure.admission import build, burst, calibrated, throughput
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import utterances
from s3flow_tools.sim.price import served_costs
from s3flow_tools.sim.streams import run_streams
from s3flow_tools.sim.virtual_server import HostCosts, VirtualServer

ROOT = Path(__file__).resolve().parents[3]
BUFFER_S = 0.3
#: a chunk's way in and out (client, gRPC, the ensemble's hops), as s3flow_tools.measure.qos prices it
TRANSIT_S = 1.3e-3
#: (label, build flags): the chunk settings compared (docs/streaming.md, results/stream_reuse.md)
SETTINGS = (("nothing kept, context 100 (the default before 2026-12-06)", ("--keep-solved", "0", "--context-frames", "100")),
            ("prompt kept, context 25 (the cpu default)", ()),
            ("every frame once, context 25 (keep_solved 2)", ("--keep-solved", "2")))
#: (label, sizes of an utterance of n tokens): the client's schedules compared
SCHEDULES = (("10, x2, 100 (the client's default)", lambda n: chunk_schedule(n)),
             ("10, x1.5, 100", lambda n: chunk_schedule(n, growth=1.5)),
             ("25, x2, 100", lambda n: chunk_schedule(n, first=25)))
RUNS = 3          # sets of sentences per n
C_STREAMS = 16


def simulate(settings, costs, schedule, n: int, offset: int, by_voice: bool = False) -> list:
    """The ``n`` sentences from ``offset`` at once on a new virtual server; ``by_voice``: each started by a voice
    whose prompt pass both solver instances made before (two short streams of it at once: a START goes to the
    instance holding the fewest), as ``served_bound`` with ``register``'s voices."""
    utts = utterances(n, offset)
    for u in utts:
        u.chunks = schedule(len(u.speech_tokens))
    server = VirtualServer(settings, costs, HostCosts(transit_s=TRANSIT_S), n_feats=80)
    at = 0.0
    if by_voice:
        for k, u in enumerate(utts):
            u.voice_id = f"v-{k}"
        warm = [dataclasses.replace(u, speech_tokens=u.speech_tokens[:10], chunks=None) for u in utts for _ in (0, 1)]
        at = max(r.wall_s for r in run_streams(server, warm, [0.0] * len(warm), rules=settings.solver.rules)) + 1.0
    return run_streams(server, utts, [at] * n, rules=settings.solver.rules)


def bound(settings, costs, schedule, by_voice: bool = False) -> dict:
    """C at ``C_STREAMS`` at once, and the largest n at once with no stream dry in any of ``RUNS`` sets."""
    out = simulate(settings, costs, schedule, C_STREAMS, 0, by_voice)
    c = sum(r.mel.shape[1] for r in out) / FRAMES_PER_SECOND / max(r.wall_s for r in out)
    best, first, dry_at = 0, float("nan"), None
    for n in range(1, 2 * C_STREAMS + 1):
        runs = [simulate(settings, costs, schedule, n, 7 * k, by_voice) for k in range(RUNS)]
        dry = [sum(r.playback_stalls(BUFFER_S)[0] > 0 for r in rs) for rs in runs]
        if any(dry):
            dry_at = (n, dry)
            break
        best, first = n, float(np.percentile([r.first_chunk_s for rs in runs for r in rs], 95))
    return {"c": c, "best": best, "first": first, "dry_at": dry_at}


def register(server: TritonServer, n: int) -> dict:
    """The prompts of the sentences ``served_bound`` and ``throughput`` stream (up to ``n`` from each set's offset),
    registered as voices, each voice's prompt pass made on both solver instances: {prompt bytes: Voice}."""
    voices = {}
    for u in [u for k in range(RUNS) for u in utterances(n, 7 * k)] + utterances(C_STREAMS):
        key = u.prompt_tokens.tobytes()
        if key not in voices:
            voices[key] = held_voice(server.grpc_url, u)
    return voices


def served_bound(server: TritonServer, c: float, voices: Optional[dict] = None) -> list:
    """(n, streams dry per set, first answer p95 s) for n = 1, 2, ... at once on ``server`` until n is past
    floor(0.8 ``c``) and past the first count with a stream dry (``voices``: started by voice id)."""
    rows, dry_seen = [], False
    for n in range(1, 2 * C_STREAMS + 1):
        sets = [[r for r, e in burst([server.grpc_url], "token2mel", n, offset=7 * k, voices=voices)[0]]
                for k in range(RUNS)]
        dry = [sum(r.playback_stalls(BUFFER_S)[0] > 0 for r in rs) for rs in sets]
        first = float(np.percentile([r.first_chunk_s for rs in sets for r in rs], 95))
        rows.append((n, dry, first))
        print(f"served{', by voice' if voices else ''}, {n} at once ({n / c:.2f} C): dry per set {dry}, first answer p95 {1000 * first:.0f} ms",
              flush=True)
        dry_seen = dry_seen or any(dry)
        if dry_seen and n > int(0.8 * c) and any(dry):
            break
    return rows


def safe_count(rows: list) -> int:
    """The most streams at once with none dry at that count and every count below it."""
    return max((n for n, dry, _ in rows if not any(dry) and all(not any(d) for m, d, _ in rows if m < n)), default=0)


def served_table(rows: list, c: float) -> list[str]:
    return (["| streams at once | as a share of C | streams dry per set (0.3 s buffer) | first answer p95 (ms) |",
             "| ---: | ---: | --- | ---: |"] +
            [f"| {n} | {n / c:.2f} | {' / '.join(map(str, dry))} | {1000 * first:.0f} |" for n, dry, first in rows])


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--warm", type=int, default=8, help="held-out sentences at once before the price is saved "
                                                       "(%(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "at_once.md", help="(default: %(default)s)")
    p.add_argument("--by-voice", action="store_true", help="the server's bound also with every stream started by "
                   "a registered voice holding its prompt's cache")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="at_once-") as tmp:
        repo = Path(tmp) / "repo"
        voice_flags = voice_encoder_flags(Path(tmp), cache_mb=256) if args.by_voice else ()
        build(repo, 0.0, voice_flags)   # (the capacity check off: every START of the burst is taken)
        with TritonServer(repo, log_file=Path(tmp) / "server.log") as server:
            calibrated(server)
            burst([server.grpc_url], "token2mel", args.warm)
            served_c, lost = throughput([server.grpc_url], "token2mel", C_STREAMS)
            if lost:
                raise SystemExit(f"{len(lost)} of the {C_STREAMS} streams that measure C failed: {lost[0]}")
            served = served_bound(server, served_c)
            by_voice = None
            if args.by_voice:
                voices = register(server, 16)
                voice_c, lost = throughput([server.grpc_url], "token2mel", C_STREAMS, voices=voices)
                if lost:
                    raise SystemExit(f"{len(lost)} of the {C_STREAMS} streams by voice that measure C failed: {lost[0]}")
                by_voice = (voice_c, served_bound(server, voice_c, voices))
        costs = served_costs(repo)   # saved by the solver instances at their close
    print(f"the server's price: estimator {costs.est_fixed * 1e3:.2f} ms + {costs.est_per_unit * 1e6:.3f} us per "
          f"row-frame + {costs.est_per_key * 1e6:.3f} us per cached key row-frame, encoder "
          f"{costs.enc_fixed * 1e3:.2f} ms + {costs.enc_per_unit * 1e6:.3f} us per token", flush=True)
    rows = []
    for label, flags in SETTINGS:
        settings = build_repository.settings_of(build_repository.parse_args(["--output", "unused", *flags]))
        for name, schedule in SCHEDULES:
            r = bound(settings, costs, schedule)
            rows.append((label, name, r))
            print(f"{label} | {name}: C {r['c']:.2f}, {r['best']} at once none dry ({r['best'] / r['c']:.2f} C); "
                  f"dry at {r['dry_at']}", flush=True)
    if args.by_voice:   # the shipped setting and schedule, every stream by a voice whose pass is made
        label, name = f"{SETTINGS[1][0]}, by voice", SCHEDULES[0][0]
        settings = build_repository.settings_of(build_repository.parse_args(["--output", "unused"]))
        r = bound(settings, costs, SCHEDULES[0][1], by_voice=True)
        rows.append((label, name, r))
        print(f"{label} | {name}: C {r['c']:.2f}, {r['best']} at once none dry ({r['best'] / r['c']:.2f} C); "
              f"dry at {r['dry_at']}", flush=True)
    before = rows[0][2]["c"]
    lines = [
        "# Streams at once with none running dry: the start-up ramp's bound",
        "",
        f"Made by `python -m s3flow_tools.measure.at_once` on {', '.join(f'{k} {v}' for k, v in machine().items())} "
        f"in {(time.monotonic() - t0) / 60:.1f} min: the simulator (`s3flow_tools.sim`, the solver's own code on a "
        f"virtual clock, `fifo` as shipped) priced by the trained small teacher's server on this host (estimator "
        f"{costs.est_fixed * 1e3:.2f} ms + {costs.est_per_unit * 1e6:.3f} us per row-frame + "
        f"{costs.est_per_key * 1e6:.3f} us per cached key row-frame, encoder "
        f"{costs.enc_fixed * 1e3:.2f} ms + {costs.enc_per_unit * 1e6:.3f} us per token); held-out sentences of 3-6 s "
        f"with their own prompts, all started together, {RUNS} sets of sentences per count, a real-time player "
        f"starting {BUFFER_S} s after each stream's first answer. The module docstring says how.",
        "",
        "| chunk setting | client schedule (tokens) | C (sim, 16 at once) | C vs the first | most at once, none dry "
        "| as a share of C | first answer p95 there (ms) | the next count: streams dry per set |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, name, r in rows:
        dry = f"{r['dry_at'][0]}: {' / '.join(map(str, r['dry_at'][1]))}" if r["dry_at"] else "none up to 32"
        lines.append(f"| {label} | {name} | {r['c']:.2f} | {r['c'] / before:.2f} | {r['best']} | "
                     f"{r['best'] / r['c']:.2f} | {1000 * r['first']:.0f} | {dry} |")
    safe = safe_count(served)
    lines += ["", f"The server itself, the shipped setting (prompt kept, context 25) and the client's default schedule, "
              f"admission off, the same {RUNS} sets of sentences per count: C {served_c:.2f} s of audio per second "
              f"({C_STREAMS} at once); **{safe} at once with none dry ({safe / served_c:.2f} C)**, where issue 48 "
              f"asks for floor(0.8 C) = {int(0.8 * served_c)}.", ""]
    lines += served_table(served, served_c)
    if by_voice is not None:
        voice_c, rows_v = by_voice
        lines += ["", f"The same server, every stream started by a registered voice whose prompt's cache its solver "
                  f"instance holds (`--by-voice`: no chunk solves a prompt frame): C {voice_c:.2f} "
                  f"({voice_c / served_c:.2f}x by prompt); **{safe_count(rows_v)} at once with none dry "
                  f"({safe_count(rows_v) / voice_c:.2f} C)**, floor(0.8 C) = {int(0.8 * voice_c)}.", ""]
        lines += served_table(rows_v, voice_c)
    lines += [""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
