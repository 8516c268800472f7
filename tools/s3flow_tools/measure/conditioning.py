"""What a streamed chunk must condition on, measured: quality on the trained model, cost served (issue 24).

Examples::

    .venv/bin/python -m s3flow_tools.measure.conditioning                  # -> results/conditioning.md
    .venv/bin/python -m s3flow_tools.measure.conditioning --quick --out /tmp/cond.md

Candidates (``ChunkSolving`` settings; every one keeps bounded context C = 100 frames and the x-vector):

* **whole prompt**: every chunk solves the whole speaker prompt + up to C emitted frames + its new frames;
* **capped prompt P**: only the prompt's last P frames (``prompt_frames``);
* **sliding prompt**: the conditioning is the last C frames of prompt ++ emitted mel (``slide_prompt``), so
  the emitted frames replace the prompt once there are C of them (optionally capped as well).

(The prompt's encoder output computed once per utterance is not a candidate: the encoder's attention is
global over prompt ++ tokens, so a prompt encoded alone is a different input, and the encoder is one call
per chunk against the estimator's 20.)

**Quality**, in process through the served chunk logic, on the trained teacher (guided, 10 steps) and the
trained vocoder: held-out sentences of four voices, each re-prompted with 6 s (150 tokens, the longest the
teacher was trained on) joined from other held-out sentences of its voice, plus one 30 s utterance joined
from held-out sentences of one voice. Per candidate: ESTOI of the vocoded stream against the recording, mel
MAE against the ground truth, voice distance (mean over bins of |time-mean of the mel - the voice's mean
log-mel|; the ground truth's own is the floor), on the 30 s one also over its last 10 s (drift once the
prompt is far behind), and seam roughness (1.0: a seam looks like any frame step). The whole prompt runs
with two noise seeds: the spread every other candidate is judged against.

**Cost**, served through a real tritonserver (``token2mel``), the small config on seeded random weights (cost
does not depend on the weights), 10 guided steps, the client's default chunk schedule: wall time of a
stream against the same utterance sent as one request (whole prompt), for prompts of 1, 3, 10 s and
utterances of 2, 5, 10, 30, 60 s, and the first chunk's latency; each the median of ``--repeats`` runs.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from s3flow_contract.tensors import FRAMES_PER_SECOND, TOKENS_PER_SECOND
from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.model.vocoder import load_vocoder
from s3flow.runtime.vocoder import vocode
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient, chunk_schedule
from s3flow_client.demo import demo_utterance
from s3flow_tools.bench.report import log, machine, markdown
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import TRAINED
from s3flow_training.evaluate import stream_utterance, synthesize_one
from s3flow_training.intelligibility import intelligibility
from s3flow_training.package import HeldoutUtterance, load_heldout
from s3flow_training.streaming_eval import seam_roughness

ROOT = Path(__file__).resolve().parents[3]
CONTEXT = 100
#: name -> ChunkSolving settings (all with context_frames = CONTEXT)
CANDIDATES = {
    "whole prompt (before)": {"prompt_frames": -1, "slide_prompt": 0},
    "prompt capped at 100 frames": {"prompt_frames": 100, "slide_prompt": 0},
    "prompt capped at 50 frames": {"prompt_frames": 50, "slide_prompt": 0},
    "prompt slides out of C": {"prompt_frames": -1, "slide_prompt": 1},
    "capped at 50, slides out of C": {"prompt_frames": 50, "slide_prompt": 1},
}
BEFORE = "whole prompt (before)"
PROMPT_TOKENS = 150


# ------------------------------------------------------------------------------------------ quality
def joined(parts: Sequence[HeldoutUtterance], n_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, mel and 16 kHz recording of ``parts`` joined (cyclically) and cut to ``n_tokens``."""
    toks, mels, refs, k = [], [], [], 0
    while sum(len(t) for t in toks) < n_tokens:
        src = parts[k % len(parts)]
        toks.append(src.speech_tokens), mels.append(src.mel), refs.append(src.reference)
        k += 1
    return (np.concatenate(toks)[:n_tokens], np.concatenate(mels, axis=1)[:, :2 * n_tokens],
            np.concatenate(refs)[:320 * 2 * n_tokens])


def quality_set(heldout: Sequence[HeldoutUtterance], voices: int, long_s: float) -> list[HeldoutUtterance]:
    """Per voice: its longest held-out sentence, prompted by 6 s joined from its other sentences; then one
    ``long_s`` utterance of the first voice joined from the sentences its prompt does not use."""
    by_voice: dict[int, list[HeldoutUtterance]] = {}
    for u in heldout:
        by_voice.setdefault(u.voice, []).append(u)
    out = []
    for v in sorted(by_voice)[:voices]:
        pool = sorted(by_voice[v], key=lambda u: -len(u.speech_tokens))
        target, others = pool[0], pool[1:]
        pt, pm, _ = joined(others, PROMPT_TOKENS)
        out.append(HeldoutUtterance(target.speech_tokens, pt, pm, target.xvector, target.mel, target.text, v,
                                    target.voice_mean, target.reference))
    v = sorted(by_voice)[0]
    pool = by_voice[v]
    prompt_src, body = pool[:2], pool[2:]
    pt, pm, _ = joined(prompt_src, PROMPT_TOKENS)
    tokens, mel, ref = joined(body, int(TOKENS_PER_SECOND * long_s))
    out.append(HeldoutUtterance(tokens, pt, pm, pool[0].xvector, mel, f"{len(body)} sentences joined", v,
                                pool[0].voice_mean, ref))
    return out


def voice_distance(mel: np.ndarray, voice_mean: np.ndarray) -> float:
    return float(np.abs(mel.mean(axis=1) - voice_mean).mean())


@dataclass
class Quality:
    estoi: float
    mae: float
    voice: float
    voice_last10: float
    seams: float


def judge(mel: np.ndarray, u: HeldoutUtterance, hift, seams: Sequence[int]) -> Quality:
    audio = vocode(hift, mel)
    last = slice(max(0, mel.shape[1] - 500), None)
    return Quality(intelligibility(u.reference, audio).estoi, float(np.abs(mel - u.mel).mean()),
                   voice_distance(mel, u.voice_mean), voice_distance(mel[:, last], u.voice_mean),
                   seam_roughness(mel, seams) if seams else float("nan"))


def measure_quality(teacher, hift, utts: Sequence[HeldoutUtterance], log_=log) -> dict[str, list[Quality]]:
    """{row name: [Quality per utterance]}: ground truth, offline, each candidate (the whole prompt twice)."""
    rows = {"ground truth mel (vocoded)": [judge(u.mel, u, hift, []) for u in utts]}
    rows["offline, whole prompt"] = [judge(synthesize_one(teacher, u, 10, 0.7, seed=k)[0], u, hift, [])
                                     for k, u in enumerate(utts)]
    log_("quality: offline done")
    runs = [(name, extra, 0) for name, extra in CANDIDATES.items()] + [(BEFORE + ", another seed", CANDIDATES[BEFORE], 100)]
    for name, extra, seed in runs:
        got = []
        for k, u in enumerate(utts):
            settings = SolverSettings.of(context_frames=CONTEXT, max_utterance_frames=max(3000, u.frames),
                                         **extra)
            s = stream_utterance(teacher, u, chunk_schedule(len(u.speech_tokens)), seed=seed + k, n_steps=10,
                                 settings=settings)
            got.append(judge(s.mel, u, hift, s.seams))
        rows[name] = got
        log_(f"quality: {name} done")
    return rows


# ------------------------------------------------------------------------------------------ cost
def served_cost(work: Path, extra: dict, prompts_s: Sequence[float], lengths_s: Sequence[float], repeats: int,
                log_=log) -> dict:
    """{(prompt s, utterance s): (stream s, one request s, first chunk s)} on one server with ``extra``."""
    flow = load_flow(write_random_checkpoint(work / "ckpt.safetensors", FlowConfig.small(), seed=4))
    solver = SolverSettings.of(context_frames=CONTEXT, max_utterance_frames=3 * 60 * FRAMES_PER_SECOND,
                               max_chunk_tokens=1500, **extra)
    repo = work / f"repo-{len(list(work.glob('repo-*')))}"
    write_repository(repo, flow, RepositorySettings(solver=solver, ort_threads=2))
    out = {}
    with TritonServer(repo, log_file=repo.with_suffix(".log")) as server:
        client = StreamingClient(server.grpc_url, timeout_s=600)
        warm = demo_utterance(2.0, seed=1)
        client.synthesize([warm])
        for p in prompts_s:
            for s in lengths_s:
                times = {"stream": [], "single": [], "first": []}
                for r in range(repeats):
                    u = demo_utterance(s, seed=10 + r, prompt_seconds=p)
                    began = {}
                    t0 = time.perf_counter()
                    client.synthesize([u], progress=lambda _: began.setdefault("t", time.perf_counter()))
                    times["stream"].append(time.perf_counter() - t0)
                    times["first"].append(began["t"] - t0)
                    u.chunks = [len(u.speech_tokens)]
                    t0 = time.perf_counter()
                    client.synthesize([u])
                    times["single"].append(time.perf_counter() - t0)
                out[(p, s)] = tuple(statistics.median(times[k]) for k in ("stream", "single", "first"))
                log_(f"cost {extra}: prompt {p:g} s, utterance {s:g} s: "
                     f"{out[(p, s)][0] / out[(p, s)][1]:.2f}x, first chunk {1000 * out[(p, s)][2]:.0f} ms")
    return out


def full_size_table(candidates: Sequence[str], prompts_s, lengths_s) -> str:
    """Full size (71 M estimator, guided 10 steps): estimator GFLOP of a stream over offline synthesis with the
    whole prompt, counted from the config over a dry run of the real engine (``planned_calls``)."""
    from s3flow.engine.planning import planned_calls
    from s3flow.model.estimator import EstimatorConfig
    from s3flow.model.flops import estimator_flops, solve_flops

    full = EstimatorConfig.full()
    names = [BEFORE, *candidates]
    header = ["utterance"] + [f"{name}: {p:g} s prompt" for name in names for p in prompts_s]
    body = []
    for secs in lengths_s:
        n = int(round(TOKENS_PER_SECOND * secs))
        chunks = chunk_schedule(n)
        row = [f"{secs:g} s"]
        for name in names:
            for p in prompts_s:
                np_ = int(round(TOKENS_PER_SECOND * p))
                offline = estimator_flops(full, 2, 2 * (np_ + n)).total * 10
                calls = planned_calls(80, np_, chunks, CONTEXT, 10, **CANDIDATES[name])
                row.append(f"{solve_flops(full, calls) / offline:.2f}x")
        body.append(row)
    first = ["first chunk GFLOP"]
    for name in names:
        for p in prompts_s:
            calls = planned_calls(80, int(round(TOKENS_PER_SECOND * p)), [10, 20], CONTEXT, 10, **CANDIDATES[name])
            first.append(f"{solve_flops(full, calls[:10]) / 1e9:,.0f}")
    return markdown(header, body + [first])


# ------------------------------------------------------------------------------------------ report
def fmt(x: float, digits: int = 3) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def quality_table(rows: dict[str, list[Quality]], n_short: int, long_s: float) -> str:
    header = ["conditioning", "ESTOI", "mel MAE", "voice distance", "seam roughness",
              f"{long_s:.0f} s: ESTOI", f"{long_s:.0f} s: voice distance", f"{long_s:.0f} s: voice distance, last 10 s"]
    body = []
    for name, qs in rows.items():
        short, long_ = qs[:n_short], qs[n_short]
        body.append([name, fmt(np.mean([q.estoi for q in short])), fmt(np.mean([q.mae for q in short])),
                     fmt(np.mean([q.voice for q in short])), fmt(np.nanmean([q.seams for q in short]), 2),
                     fmt(long_.estoi), fmt(long_.voice), fmt(long_.voice_last10)])
    return markdown(header, body)


def cost_table(costs: dict[str, dict], prompts_s, lengths_s) -> str:
    """Stream wall time of each setting over the whole-prompt one-request time (what offline costs)."""
    offline = costs["before"]
    header = ["utterance"] + [f"{name}: {p:g} s prompt" for name in costs for p in prompts_s]
    body = []
    for s in lengths_s:
        body.append([f"{s:g} s"] + [fmt(c[(p, s)][0] / offline[(p, s)][1], 2) + "x"
                                    for c in costs.values() for p in prompts_s])
    body.append(["first chunk"] + [f"{1000 * c[(p, lengths_s[0])][2]:.0f} ms" for c in costs.values()
                                   for p in prompts_s])
    return markdown(header, body)


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--trained", type=Path, default=TRAINED, help="(default: %(default)s)")
    p.add_argument("--voices", type=int, default=4, help="voices in the quality set (default: %(default)s)")
    p.add_argument("--long-s", type=float, default=30.0, help="the long quality utterance (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="served runs per cell (default: %(default)s)")
    p.add_argument("--candidates", nargs="+", default=["prompt capped at 50 frames", "capped at 50, slides out of C"],
                   choices=sorted(CANDIDATES), help="the candidates whose cost is served beside the old default "
                   "(default: %(default)s; the first is the served default, s3flow.engine.settings.ChunkSolving)")
    p.add_argument("--quick", action="store_true", help="2 voices, a 12 s long one, fewer cost cells")
    p.add_argument("--lengths", type=float, nargs="+", default=[2.0, 5.0, 10.0, 30.0, 60.0],
                   help="utterance seconds of the cost table (default: %(default)s)")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "conditioning.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    prompts_s, lengths_s = (1.0, 3.0, 10.0), tuple(args.lengths)
    if args.quick:
        args.voices, args.long_s, args.repeats, lengths_s = 2, 12.0, 1, (2.0, 10.0)
    sections = []
    if not args.skip_quality:
        teacher = load_flow(args.trained / "teacher.safetensors")
        hift = load_vocoder(args.trained / "vocoder.safetensors")
        utts = quality_set(load_heldout(args.trained / "heldout.npz"), args.voices, args.long_s)
        rows = measure_quality(teacher, hift, utts)
        table = quality_table(rows, len(utts) - 1, utts[-1].frames / FRAMES_PER_SECOND)
        sections.append(("quality", table, rows, utts))
    work = Path(tempfile.mkdtemp(prefix="conditioning-"))
    costs = {"before": served_cost(work, CANDIDATES[BEFORE], prompts_s, lengths_s, args.repeats)}
    for name in args.candidates:
        costs[name] = served_cost(work, CANDIDATES[name], prompts_s, lengths_s, args.repeats)
    write_report(args, sections, costs, prompts_s, lengths_s, time.perf_counter() - t0)
    return 0


def write_report(args, sections, costs, prompts_s, lengths_s, wall_s: float) -> None:
    L = ["# Conditioning a streamed chunk: quality and cost", "",
         f"Written by `python -m s3flow_tools.measure.conditioning{' --quick' if args.quick else ''}` "
         f"({time.strftime('%Y-%m-%d')}, {wall_s / 60:.1f} min; {json.dumps(machine())}). Every candidate keeps "
         f"bounded context C = {CONTEXT} frames and the x-vector; the script's docstring says what each row is.", ""]
    for _, table, rows, utts in sections:
        n = len(utts) - 1
        L += ["## Quality (trained teacher, guided 10 steps, trained vocoder; in process)", "",
              f"{n} held-out sentences ({', '.join(f'voice {u.voice}' for u in utts[:n])}), each prompted with "
              f"{PROMPT_TOKENS / TOKENS_PER_SECOND:g} s joined from other held-out sentences of its voice, and one "
              f"{utts[n].frames / FRAMES_PER_SECOND:.0f} s utterance of voice {utts[n].voice} ({utts[n].text}). "
              "Means over the short ones; the last three columns are the long one.", "", table, ""]
    L += ["## Cost (served: token2mel on a real tritonserver; small config, seeded weights, 10 guided steps)", "",
          "Stream wall time over the same utterance sent as one request with the whole prompt (the old default's "
          "server: what offline synthesis costs), the client's "
          f"default chunk schedule (10, 20, 40, 80, 100 tokens); median of {args.repeats} run(s). First chunk: "
          f"the {lengths_s[0]:g} s utterance's first response.", "", cost_table(costs, prompts_s, lengths_s), "",
          "## Full size (71 M estimator, guided 10 steps): estimator cost, counted", "",
          "Estimator GFLOP of the stream over offline synthesis with the whole prompt, from the config "
          "(`s3flow.model.flops`) over a dry run of the real `StreamingEngine` with stand-in models "
          "(`planned_calls`); the last row: the first chunk's 10 guided steps.", "",
          full_size_table(args.candidates, prompts_s, lengths_s), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(L))
    print("\n".join(L))


if __name__ == "__main__":
    sys.exit(main())
