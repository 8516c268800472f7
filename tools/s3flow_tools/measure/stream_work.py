"""What a streamed utterance makes the server solve, against the same utterance in one request (issue 50, step 1).

Examples::

    .venv/bin/python -m s3flow_tools.measure.stream_work                  # -> results/stream_work.md (~6 min)
    .venv/bin/python -m s3flow_tools.measure.stream_work --no-served --out /tmp/work.md     # the count alone

1. **The count**, from the engine's own plan (``s3flow.engine.planning.planned_calls``: the served chunk logic
   over stand-in networks) with the served chunk settings (prompt capped at ``prompt_frames``, ``context_frames``
   of context) and the client's default chunk schedule, for 1 / 3 / 10 s prompts and 2 / 5 / 10 / 30 s
   utterances: the frames each Euler step solves (queries), per second of audio, chunk by chunk, and the
   full-size estimator's FLOPs (``s3flow.model.flops``: attention grows with queries x keys, the rest with the
   queries), guided, 10 steps. Beside today's scheme, what the schemes of issue 50 would solve: the prompt's keys
   and values kept (one prompt pass per stream, every chunk's prompt rows no longer queried), the same with 25
   frames of context, and every frame solved once (prompt and context kept). The one-request synthesis of the
   same utterance (one chunk: the capped prompt and every frame, once) is the unit.
2. **Served wall time** (``--served``): the trained small teacher (``checkpoints/trained``) behind ``token2mel``
   as ``make demo`` builds it, admission off, one stream at a time through ``StreamingClient``: each utterance
   streamed on the default schedule and sent as one request, median of ``--runs`` each, interleaved; one server
   per ``--solving`` setting (keep_solved:context_frames; docs/streaming.md), side by side. A setting ending in
   ``:voice`` (``1:25:voice``) serves registered voices holding their prompt's cache (``voice_cache_mb``,
   ``s3flow.engine.voice_prompts``): each utterance's prompt is registered and two short streams by its id make
   the voice's prompt pass on both solver instances before the timed ones, which start by voice id (streamed and
   one request alike).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from s3flow_contract.tensors import FRAMES_PER_SECOND, TOKENS_PER_SECOND
from s3flow.engine.planning import planned_calls
from s3flow.engine.settings import ChunkSolving
from s3flow.model.estimator import EstimatorConfig
from s3flow.model.flops import estimator_flops
from s3flow_client import StreamingClient, chunk_schedule
from s3flow_client.demo import demo_utterance
from s3flow_tools.bench.report import machine
from s3flow_tools.measure.command import command
from s3flow_tools.measure.corpus import TRAINED

ROOT = Path(__file__).resolve().parents[3]
PROMPTS_S, UTTERANCES_S = (1, 3, 10), (2, 5, 10, 30)
STEPS, LOOKAHEAD = 10, 6
SCHEMES = ("today", "prompt kept", "prompt kept, context 25", "each frame once")


@dataclass
class Window:
    """One chunk's estimator window: its ``frames`` (queries today), of which ``prompt`` are the capped prompt,
    ``context`` the mel already made, ``new`` solved for the first time."""
    frames: int
    prompt: int
    context: int

    @property
    def new(self) -> int:
        return self.frames - self.prompt - self.context


def windows(prompt_tokens: int, chunks: list[int], context_frames: int, prompt_frames: int) -> list[Window]:
    """Each chunk's window as the engine plans it (one call per chunk: the frames of every step of it)."""
    calls = planned_calls(80, prompt_tokens, chunks, context_frames, steps=1, prompt_frames=prompt_frames)
    prompt = 2 * prompt_tokens if prompt_frames < 0 else min(2 * prompt_tokens, prompt_frames)
    out, made = [], 0
    for k, ((_, frames), tokens) in enumerate(zip(calls, chunks)):
        out.append(Window(frames, prompt, min(context_frames, made) if context_frames >= 0 else made))
        made = 2 * sum(chunks[:k + 1]) - LOOKAHEAD
    return out


def scheme_calls(scheme: str, prompt_tokens: int, chunks: list[int], solving: ChunkSolving) -> list[tuple[int, int]]:
    """(queries, keys) of each chunk's step under ``scheme`` (module docstring), and the prompt pass first where
    the scheme keeps the prompt's keys and values (its step: the prompt's frames alone)."""
    context = 25 if scheme == "prompt kept, context 25" else solving.context_frames
    ws = windows(prompt_tokens, chunks, context, solving.prompt_frames)
    if scheme == "today":
        return [(w.frames, w.frames) for w in ws]
    kept = [(ws[0].prompt, ws[0].prompt)]   # one pass over the prompt per stream, per step
    if scheme == "each frame once":
        return kept + [(w.new, w.frames) for w in ws]
    return kept + [(w.frames - w.prompt, w.frames) for w in ws]


def count(prompt_s: float, utterance_s: float, solving: ChunkSolving, config: EstimatorConfig) -> dict:
    """Per scheme and for one request: query frames per step per audio second, full-size GFLOP per audio second
    (attention apart), and today's windows chunk by chunk."""
    prompt_tokens, tokens = round(TOKENS_PER_SECOND * prompt_s), round(TOKENS_PER_SECOND * utterance_s)
    chunks = chunk_schedule(tokens)
    audio_s = 2 * tokens / FRAMES_PER_SECOND
    out = {"chunks": chunks, "windows": windows(prompt_tokens, chunks, solving.context_frames, solving.prompt_frames)}
    one = scheme_calls("today", prompt_tokens, [tokens], solving)
    for name, calls in [("one request", one)] + [(s, scheme_calls(s, prompt_tokens, chunks, solving)) for s in SCHEMES]:
        flops = [estimator_flops(config, 2, q, k) for q, k in calls]
        out[name] = {"queries": sum(q for q, _ in calls) / audio_s,
                     "gflop": STEPS * sum(f.total for f in flops) / audio_s / 1e9,
                     "attention": STEPS * sum(f.attention for f in flops) / audio_s / 1e9}
    return out


def count_section(solving: ChunkSolving) -> list[str]:
    config = EstimatorConfig.full()
    lines = ["## The count (the engine's plan; full-size estimator, guided, 10 steps)", "",
             f"Served chunk settings: prompt capped at {solving.prompt_frames} frames, {solving.context_frames} frames "
             f"of context, the client's default chunk schedule (10 tokens, x2, up to 100), {LOOKAHEAD} lookahead "
             f"frames held back until the END. Query frames per Euler step per second of audio, and the ratio to "
             f"one request of the same utterance; GFLOP per second of audio (10 guided steps, 2 rows), attention's "
             f"share beside it. The prompt's length changes none of it past {solving.prompt_frames // 2} tokens "
             f"(the cap); it changes the encoder's work (prompt + context + new tokens each chunk).", ""]
    head = "| prompt | utterance | one request: frames/s, GFLOP/s | " + " | ".join(
        f"{s}: frames/s (x), GFLOP/s (x)" for s in SCHEMES) + " |"
    lines += [head, "|" + " --- |" * (3 + len(SCHEMES))]
    detail = None
    for p in PROMPTS_S:
        for u in UTTERANCES_S:
            c = count(p, u, solving, config)
            one = c["one request"]
            cells = [f"{c[s]['queries']:.0f} ({c[s]['queries'] / one['queries']:.2f}x), {c[s]['gflop']:.0f} "
                     f"({c[s]['gflop'] / one['gflop']:.2f}x; attention {100 * c[s]['attention'] / c[s]['gflop']:.0f} %)"
                     for s in SCHEMES]
            lines.append(f"| {p} s | {u} s | {one['queries']:.0f}, {one['gflop']:.0f} | " + " | ".join(cells) + " |")
            if (p, u) == (10, 5):
                detail = c
    lines += ["", "A 5 s utterance with a 10 s prompt, chunk by chunk (today: every step solves the whole window):", "",
              "| chunk | tokens | window frames | prompt | context | new |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k, (n, w) in enumerate(zip(detail["chunks"], detail["windows"])):
        lines.append(f"| {k + 1} | {n} | {w.frames} | {w.prompt} | {w.context} | {w.new} |")
    total = sum(w.frames for w in detail["windows"])
    one = detail["one request"]["queries"] * 2 * 125 / FRAMES_PER_SECOND
    lines += ["", f"In all {total} frames a step against {one:.0f} for one request ({total / one:.2f}x).", ""]
    return lines


def served_section(runs: int, solvings: list[tuple]) -> list[str]:
    """The served wall time, streamed over one request, on one server per (``keep_solved``, ``context_frames``,
    by voice); a by-voice server also times the same utterances sent with their prompts, interleaved."""
    walls = {k: served_walls(runs, *k) for k in solvings}
    columns = []   # (heading, setting, the streamed mode, the one-request mode)
    for k in walls:
        name = f"keep_solved {k[0]}, context {k[1]}"
        if k[2:]:
            columns += [(f"{name}, by voice", k, "streamed", "one request"),
                        (f"{name}, by prompt (the same server)", k, "streamed, by prompt", "one request, by prompt")]
        else:
            columns.append((name, k, "streamed", "one request"))
    lines = ["## Served wall time (trained small teacher, `token2mel`, one stream at a time)", "",
             f"Median of {runs} interleaved runs each: the utterance streamed on the client's default schedule "
             f"(first answer to last; the stream's first answer beside it) against the same utterance in one "
             f"request; admission off; one server per `keep_solved` and context (docs/streaming.md: 0 solves prompt "
             f"and context again in every chunk, 1 keeps the prompt, 2 every frame once); a server serving voices "
             f"times the streams by voice id and by prompt interleaved.", "",
             "| prompt | utterance | " + " | ".join(f"{h}: streamed / one request (s), first answer"
                                                   for h, *_ in columns) + " |",
             "| --- | --- |" + " ---: |" * len(columns)]
    for cell in walls[solvings[0]]:
        parts = []
        for _, k, streamed, one in columns:
            (s, first), (o, _) = walls[k][cell][streamed], walls[k][cell][one]
            parts.append(f"{s / o:.2f}x ({s:.2f} / {o:.2f}), {1000 * first:.0f} ms")
        lines.append(f"| {cell[0]} s | {cell[1]} s | " + " | ".join(parts) + " |")
    return lines + [""]


def served_walls(runs: int, keep_solved: int, context_frames: int, by_voice: bool = False) -> dict:
    """{(prompt s, utterance s): {mode: (wall s, first answer s)}}, medians of ``runs`` interleaved runs; modes
    "streamed" and "one request" (and, ``by_voice``, the same "by prompt")."""
    from s3flow.repository import cli as build_repository
    from s3flow.server.triton_server import TritonServer
    from s3flow.server.metrics_reader import wait_priced
    from s3flow_tools.bench.voices import held_voice, voice_encoder_flags

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        voices = voice_encoder_flags(Path(tmp)) if by_voice else ["--no-voice"]
        if build_repository.main(["--checkpoint", str(TRAINED / "teacher.safetensors"), "--output", str(repo),
                                  *voices, "--utilization-target", "0", "--keep-solved", str(keep_solved),
                                  "--context-frames", str(context_frames)]) != 0:
            raise SystemExit("building the repository failed")
        with TritonServer(repo, log_file=Path(tmp) / "server.log") as server:
            wait_priced(f"127.0.0.1:{server.metrics_port}")   # its calibration must not share the cores with a stream
            client = StreamingClient(server.grpc_url, "token2mel", timeout_s=300, max_retries=0, max_resumes=0)
            client.synthesize([demo_utterance(3.0, seed=1)])   # warm
            modes = ["streamed", "one request"] + (["streamed, by prompt", "one request, by prompt"] if by_voice else [])
            for p in PROMPTS_S:
                for u in UTTERANCES_S:
                    got: dict[str, list] = {m: [] for m in modes}
                    for r in range(runs):
                        utt = demo_utterance(u, seed=100 + r, prompt_seconds=p)
                        voice = None
                        if by_voice:   # registered, its prompt pass made (bench.voices)
                            voice = held_voice(server.grpc_url, utt)
                            utt = voice.utterance(utt.speech_tokens, seed=utt.seed)
                        for mode in modes:   # interleaved
                            utt.chunks = None if mode.startswith("streamed") else [len(utt.speech_tokens)]
                            utt.voice_id = None if voice is None or mode.endswith("by prompt") else voice.voice_id
                            t0 = time.monotonic()
                            [res] = client.synthesize([utt])
                            if res.error is not None:
                                raise SystemExit(f"{mode} {p} s / {u} s: {res.error}")
                            got[mode].append((time.monotonic() - t0, res.first_chunk_s))
                    rows[(p, u)] = {m: (statistics.median(w for w, _ in v), statistics.median(f for _, f in v))
                                    for m, v in got.items()}
                    print(f"  served, keep_solved {keep_solved}, context {context_frames}, by voice {by_voice}: prompt "
                          f"{p} s, {u} s: " + ", ".join(f"{m} {w:.2f} s (first {1000 * f:.0f} ms)"
                                                       for m, (w, f) in rows[(p, u)].items()), flush=True)
    return rows


def main(argv=None) -> int:
    p = command(__file__, __doc__)
    p.add_argument("--served", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="also the served wall time (%(default)s)")
    p.add_argument("--runs", type=int, default=3, help="served runs of each (%(default)s)")
    p.add_argument("--solving", nargs="+", default=["0:100", "1:100", "2:100"],
                   help="the served settings compared, one server each, as keep_solved:context_frames (%(default)s: "
                        "the count's context; the cpu target's default is 1:25); 1:25:voice: streams started by "
                        "registered voices that hold their prompt's cache")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "stream_work.md", help="(default: %(default)s)")
    args = p.parse_args(argv)
    solving = ChunkSolving()
    lines = ["# What a stream makes the server solve (issue 50, step 1)", "",
             f"Made by `python -m s3flow_tools.measure.stream_work` on "
             f"{', '.join(f'{k} {v}' for k, v in machine().items())}.", ""]
    lines += count_section(solving)
    if args.served:
        solvings = [tuple(int(v) if v != "voice" else True for v in s.split(":")) for s in args.solving]
        lines += served_section(args.runs, solvings)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
