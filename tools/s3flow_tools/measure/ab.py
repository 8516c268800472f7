"""This checkout's server against another's on the same host, interleaved: C, a stream alone, a chunk's fixed cost.

A change to the server (a scheduler, a loop, a hop) is judged against the code before it in the same run: this
host's noise moves C by 10-15 % from one run to the next, more than most changes do. The other checkout is any
git checkout with its own ``.venv`` (``git worktree add /tmp/before <commit> && make -C /tmp/before setup``);
each round starts one server from each (``fifo`` by default, the trained small teacher and vocoder, ``token2mel``
unless ``--model token2wav``, the admission step on with its capacity check off, so every START is taken as in
``s3flow_tools.measure.qos``), each
checkout's own code serving (a server's python models import the package installed in the venv that starts it),
and measures

* its start: seconds from launch until the server answers ready, and each python stub's resident memory then;
* a stream alone: ``--alone`` held-out sentences one after the other (first mel, wall time per second of audio,
  and each model's CPU seconds over them, its stubs summed: what a model burns beyond its work shows here);
* the fixed cost of a chunk: the first ``FIXED_TOKENS`` tokens of each of those sentences sent as a one-chunk
  utterance at 2 and at 4 Euler steps; what the client waits for its answer is a fixed part (client, gRPC,
  admission, the encoder, the hops, the Python around the steps) plus the steps, so ``2 T(2) - T(4)`` is the fixed
  part (issue 49's figure; its median over the sentences);
* C: ``--at-once`` held-out sentences started together, ``--c-runs`` times (seconds of audio per second).

Both sides are measured by this checkout's ``ab.py`` (run by the other checkout's python, so each serves its own
code).

``--flags`` and ``--other-flags`` add ``scripts/build_repository.py`` flags to either side's repository: two
settings of one checkout are compared with ``--other .`` (the same checkout twice).

Examples::

    .venv/bin/python -m s3flow_tools.measure.ab --other /tmp/before --label "fifo through one loop" \\
        --other-label "fifo before the loop merge (2212a02)" --out results/one_loop.md
    .venv/bin/python -m s3flow_tools.measure.ab --other . --flags="--keep-solved 2" --label "keep_solved 2" \\
        --other-label "keep_solved 0" --rounds 2 --out results/keep_solved.md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from s3flow_tools.measure.command import command

ROOT = Path(__file__).resolve().parents[3]
#: the one chunk whose answer time measures a chunk's fixed cost (tokens)
FIXED_TOKENS = 40


def one_side(scheduling: str, alone: int, at_once: int, c_runs: int, flags: list[str] = (),
             model: str = "token2mel") -> dict:
    """This checkout's server (the caller: the checkout's own python): its figures."""
    from s3flow_contract.tensors import FRAMES_PER_SECOND
    from s3flow.repository import cli as build_repository
    from s3flow.server.triton_server import TritonServer
    from s3flow.server.metrics_reader import wait_priced
    from s3flow_tools.measure.corpus import TRAINED, utterances
    from s3flow_tools.measure.qos import MODES, streams

    import psutil

    from s3flow.server.healing import stubs
    from s3flow_tools.bench.load import rss_mb

    def cpu_by_model(pids: dict) -> dict:
        used: dict = {}
        for pid, stub in pids.items():
            t = psutil.Process(pid).cpu_times()
            used[stub] = used.get(stub, 0.0) + t.user + t.system
        return used

    out = {"alone_first_s": [], "alone_wall_per_audio": [], "fixed_s": [], "c": [], "ready_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        if build_repository.main(["--checkpoint", str(TRAINED / "teacher.safetensors"), "--output", str(repo),
                                  "--vocoder-checkpoint", str(TRAINED / "vocoder.safetensors"),
                                  "--no-voice", "--utilization-target", "0", *MODES[scheduling], *flags]) != 0:
            raise SystemExit("building the repository failed")
        t0 = time.monotonic()
        with TritonServer(repo, log_file=Path(tmp) / "server.log") as server:
            out["ready_s"].append(time.monotonic() - t0)
            for pid, stub in sorted(stubs(server.pid).items()):
                out.setdefault(f"stub_mib:{stub}", []).append(rss_mb(pid))
            wait_priced(f"127.0.0.1:{server.metrics_port}")   # its calibration must not share the cores with a stream
            streams(server.grpc_url, model, utterances(2), 0.0)   # warm the client path
            pids = stubs(server.pid)
            cpu_before = cpu_by_model(pids)
            for k in range(alone):
                [r], wall = streams(server.grpc_url, model, utterances(1, offset=k), 0.0)
                if r.error is not None:
                    raise SystemExit(f"a stream failed: {r.error}")
                out["alone_first_s"].append(r.first_chunk_s)
                out["alone_wall_per_audio"].append(wall / (r.mel.shape[1] / FRAMES_PER_SECOND))
            for stub, seconds in cpu_by_model(pids).items():
                out.setdefault(f"cpu_s:{stub}", []).append(seconds - cpu_before[stub])
            for k in range(alone):   # a chunk's fixed cost: 2 T(2 steps) - T(4 steps) of one chunk (module docstring)
                [u] = utterances(1, offset=k)
                u = dataclasses.replace(u, speech_tokens=u.speech_tokens[:FIXED_TOKENS], chunks=[FIXED_TOKENS])
                answered = {}
                for steps in (2, 4):
                    [r], _ = streams(server.grpc_url, model, [dataclasses.replace(u, n_timesteps=steps)], 0.0)
                    if r.error is not None:
                        raise SystemExit(f"a one-chunk utterance failed: {r.error}")
                    answered[steps] = r.first_chunk_s
                out["fixed_s"].append(2 * answered[2] - answered[4])
            for _ in range(c_runs):
                results, wall = streams(server.grpc_url, model, utterances(at_once), 0.0)
                if any(r.error is not None for r in results):
                    raise SystemExit("a stream failed at saturation")
                out["c"].append(sum(r.mel.shape[1] for r in results) / FRAMES_PER_SECOND / wall)
    return out


def run_side(checkout: Path, args, flags: str = "") -> dict:
    """``one_side`` run by ``checkout``'s own python, in it, its repository built with ``flags``."""
    cmd = [str(checkout / ".venv" / "bin" / "python"), "-m", "s3flow_tools.measure.ab", "--one-side",
           "--scheduling", args.scheduling, "--alone", str(args.alone), "--at-once", str(args.at_once),
           "--c-runs", str(args.c_runs), "--model", args.model] + ([f"--flags={flags}"] if flags else [])
    cmd[1:3] = [str(Path(__file__).resolve())]   # measured alike: this checkout's measuring code, its served code
    run = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("AB ")]
    if run.returncode != 0 or not lines:
        raise SystemExit(f"{checkout}: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return json.loads(lines[-1][3:])


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--other", type=Path, help="the other checkout (with its own .venv)")
    p.add_argument("--label", default="this checkout", help="(default: %(default)s)")
    p.add_argument("--other-label", default="the other checkout", help="(default: %(default)s)")
    p.add_argument("--scheduling", default="fifo", choices=("fifo", "deadline", "fewer"), help="(default: %(default)s)")
    p.add_argument("--model", default="token2mel", choices=("token2mel", "token2wav"), help="(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="servers per checkout, alternating (default: %(default)s)")
    p.add_argument("--alone", type=int, default=8, help="streams alone per server (default: %(default)s)")
    p.add_argument("--at-once", type=int, default=16, help="streams that measure C (default: %(default)s)")
    p.add_argument("--c-runs", type=int, default=3, help="C measurements per server (default: %(default)s)")
    p.add_argument("--flags", default="", help="build_repository flags of this side (default: none)")
    p.add_argument("--other-flags", default="", help="build_repository flags of the other side (default: none)")
    p.add_argument("--out", type=Path, help="a markdown report (default: print it only)")
    p.add_argument("--one-side", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_side:
        print("AB " + json.dumps(one_side(args.scheduling, args.alone, args.at_once, args.c_runs,
                                          shlex.split(args.flags), args.model)), flush=True)
        return 0
    if args.other is None or not (args.other / ".venv" / "bin" / "python").is_file():
        p.error("--other: a checkout with its own .venv (make setup in it)")
    if args.label == args.other_label:
        p.error("--label and --other-label must differ")
    sides = {args.label: (ROOT, args.flags), args.other_label: (args.other.resolve(), args.other_flags)}
    got: dict[str, dict] = {label: {} for label in sides}
    for k in range(args.rounds):
        for label, (checkout, flags) in (sides.items() if k % 2 == 0 else reversed(sides.items())):
            figures = run_side(checkout, args, flags)
            for key, values in figures.items():
                got[label].setdefault(key, []).extend(values)
            print(f"round {k + 1}, {label}: C {np.mean(figures['c']):.2f}, alone first mel p50 "
                  f"{1000 * np.median(figures['alone_first_s']):.0f} ms", flush=True)
    from s3flow_tools.bench.report import machine

    mine, theirs = got[args.label], got[args.other_label]
    def row(name, key, scale=1.0, stat=np.mean, fmt=".2f"):
        a, b = stat(mine[key]) * scale, stat(theirs[key]) * scale
        return f"| {name} | {a:{fmt}} | {b:{fmt}} | {f'{a / b:.2f}' if b else '-'} |"

    lines = [f"# {args.label} against {args.other_label}", "",
             f"Made by `python -m s3flow_tools.measure.ab --other {args.other} --scheduling {args.scheduling} "
             f"{f'--model {args.model} ' if args.model != 'token2mel' else ''}"
             f"--rounds {args.rounds}"
             f"{f' --flags={chr(34)}{args.flags}{chr(34)}' if args.flags else ''}"
             f"{f' --other-flags={chr(34)}{args.other_flags}{chr(34)}' if args.other_flags else ''}` on {', '.join(f'{k} {v}' for k, v in machine().items())}: the trained small "
             f"teacher (10 guided steps), `{args.model}`, the admission step on with its capacity check off, "
             f"`{args.scheduling}`; {args.rounds} servers "
             f"from each checkout, alternating; per server {args.alone} held-out sentences alone, as many one-chunk "
             f"utterances of their first {FIXED_TOKENS} tokens at 2 and 4 steps, then "
             f"{args.c_runs} x {args.at_once} at once (C).", "",
             f"| figure | {args.label} | {args.other_label} | ratio |", "| --- | ---: | ---: | ---: |",
             row(f"C, s of audio per s (mean of {len(mine['c'])})", "c"),
             f"| C, standard deviation | {np.std(mine['c']):.2f} | {np.std(theirs['c']):.2f} | |",
             row("a stream alone: first mel p50 (ms)", "alone_first_s", 1000, np.median, ".0f"),
             row("a stream alone: first mel mean (ms)", "alone_first_s", 1000, np.mean, ".0f"),
             row("a stream alone: wall time per second of audio", "alone_wall_per_audio", 1, np.mean, ".3f"),
             row(f"the fixed cost of a chunk: 2 T(2 steps) - T(4 steps), one {FIXED_TOKENS}-token chunk (ms, median)",
                 "fixed_s", 1000, np.median, ".1f"),
             row("start: launch to ready (s)", "ready_s", 1, np.median, ".1f")]
    stubs = sorted(k for k in mine if k.startswith("stub_mib:") and k in theirs)
    lines += [row(f"`{k.split(':', 1)[1]}` stub resident memory at ready (MiB)", k, 1, np.median, ".0f")
              for k in stubs]
    cpu = sorted(k for k in mine if k.startswith("cpu_s:") and k in theirs)
    lines += [row(f"`{k.split(':', 1)[1]}` CPU over the {args.alone} streams alone (s, its stubs summed; median)", k,
                  1, np.median, ".2f") for k in cpu] + [""]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
