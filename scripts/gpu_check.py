#!/usr/bin/env python3
"""One-shot GPU check of the flow on seeded random weights: precision, speed, and TensorRT where installed.

Runs from a fresh copy of the repository with the system ``python3`` of a GPU host (torch with CUDA; our
.venv is not needed; nothing is downloaded; safetensors, onnx, onnxruntime and tensorrt are optional)::

    python3 scripts/gpu_check.py --out results            # full size on cuda:0 (not done in 470 s on one H200)
    python3 scripts/gpu_check.py --out results --sections scaling   # one section (each prints as it goes)
    python3 scripts/gpu_check.py --device cpu --quick     # small config on the CPU: every code path, seconds

What it does (full size: 50 prompt + 100 speech tokens, 2 s of audio per utterance):

1. precision: the whole flow (encoder + 10-step guided Euler solve, and a meanflow model's 2 steps) on
   the device in fp32 (TF32 off), TF32, bf16 and fp16 autocast (the torch backend's modes) against the
   same flow in fp32 on the CPU: relative L2 error of the mel, and NaN/inf. A plain ``module.half()`` is
   reported beside them (information only: no fp32 islands).
2. the device-resident streaming engine (what ``cfm_solver`` runs) against offline synthesis on the device.
3. estimator forward at B = 2 (one guided utterance), T = 100 / 300 / 600 frames: ms and TFLOP/s per mode.
4. the whole flow, 10-step guided and meanflow 2 steps: device vs CPU wall time, side by side.
5. throughput of the streaming engine at batch 1..16 (one finalising chunk per utterance).
6. TensorRT, when ``import tensorrt`` works (and onnx is there): ONNX export, fp32 and fp16 estimator
   engines and an fp32 encoder engine on a narrow profile, parity against torch fp32, timings, and the
   whole flow on the fp16 engine. Where TensorRT is missing it says so and builds nothing.
7. scaling: estimator per call against rows (2..256) and frames (64/150/300) in tf32/bf16/fp16 and as a bf16
   CUDA graph, the encoder against its batch (the per-call figures a projection of many streams reads).
8. token2wav with the vocoder on the device (HiFT in torch fp32, what the gpu target's ``vocoder`` model
   runs): offline vocoding on the device vs the CPU, and the streaming engine feeding a ``VocoderStream``
   chunk by chunk against offline vocoding of the streamed mel; time to first audio, RTF.

Writes ``<out>/gpu_check.md`` and ``<out>/gpu_check.json``. Exit status 1 when a check failed (NaN, or an
error above its bound, or a section raised), else 0. Bounds (relative L2 of the final mel against CPU
fp32): fp32 1e-3, TF32 1e-2, fp16 2e-2, bf16 5e-2; streamed vs offline 1e-3; engines as
``s3flow.runtime.tensorrt.PARITY_BOUNDS``; vocoder (relative L2 of the audio) device vs CPU 1e-4, streamed vs
offline on the device 1e-5.

The report, the plans and flows, and the sections that need no streaming engine (precision, estimator,
TensorRT) live in ``s3flow_tools.gpu_check``; the streaming sections (engine, token2wav, throughput) are here.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("python_backend", "contract", "tools"):  # no install: the GPU host has torch but not our .venv
    sys.path.insert(0, str(ROOT / sub))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from s3flow_contract.tensors import TOKENS_PER_SECOND  # noqa: E402
from s3flow.engine.streaming import StreamingEngine  # noqa: E402
from s3flow.model.flow import FlowConfig  # noqa: E402
from s3flow.model.solver import FrameNoise  # noqa: E402
from s3flow.engine.sequences import SequenceLimits  # noqa: E402
from s3flow.engine.settings import ChunkSolving  # noqa: E402
from s3flow.serving.incoming import Incoming  # noqa: E402
from s3flow.serving.session import SolverSession  # noqa: E402
from s3flow.runtime import tensorrt as tb  # noqa: E402
from s3flow_tools.gpu_check.flows import (FULL, QUICK, FlowModes, Plan, Utterance, initial_noise, random_flow,  # noqa: E402
                                            request, set_tf32, utterance)
from s3flow_tools.gpu_check.report import BOUNDS, Clock, Report, environment, rel_error, table  # noqa: E402
from s3flow_tools.gpu_check.sections import (estimator_section, precision_section, scaling_section,  # noqa: E402
                                             tensorrt_section)


def device_engine(fm: FlowModes, estimator) -> StreamingEngine:
    dev, enc = fm.device, fm.dev.encoder

    def encode(tokens, token_len, embedding):
        with torch.inference_mode():
            return enc(tokens.to(dev), token_len.to(dev), embedding.to(dev))
    return StreamingEngine(encode, estimator, n_feats=fm.dev.config.n_feats, meanflow=fm.dev.config.meanflow,
                           limits=SequenceLimits(max_live_sequences=256))


def served_prompt(u: Utterance, solving: ChunkSolving, n_feats: int) -> tuple[Utterance, torch.Tensor]:
    """``u`` as the engine conditions it, and its starting noise: where the engine caps the prompt (the served
    default) the last ``solving.prompt_frames`` frames (whole tokens), their noise the tail of the whole prompt's,
    so that offline synthesis of it from that noise is the engine's reference."""
    frames = 2 * len(u.prompt)
    if solving.prompt_frames < 0 or frames <= solving.prompt_frames:
        return u, initial_noise(u, n_feats)
    keep = solving.prompt_frames // 2
    noise = FrameNoise(u.seed, n_feats)
    z = np.concatenate([noise.prompt(frames)[:, frames - 2 * keep:], noise.frames(0, 2 * len(u.speech))], axis=1)
    return (dataclasses.replace(u, prompt=u.prompt[-keep:], prompt_mel=u.prompt_mel[-2 * keep:]),
            torch.from_numpy(z)[None])


def answers(session: SolverSession, incoming: list[Incoming]) -> list:
    """The results of one batch of requests through the served session logic (raises on an error answer)."""
    outcomes = session.handle(incoming)
    errors = [o.error for o in outcomes if o.error is not None]
    if errors:
        raise RuntimeError("; ".join(errors))
    return [o.result for o in outcomes]


def run_batch(engine: StreamingEngine, utts: list[Utterance], base_id: int, steps: int) -> list:
    """Each utterance as one START+END request, all in one batch (one padded solve)."""
    return answers(SolverSession(engine), [Incoming(base_id + i, start=True, end=True, inputs=request(u, steps))
                                           for i, u in enumerate(utts)])


def streaming_section(rep: Report, fm: FlowModes, plan: Plan) -> None:
    fm.estimator("fp32")
    engine = device_engine(fm, fm.runners["fp32"].estimator)
    utts = [utterance(plan, seed=10 + i) for i in range(2)]
    utts[1].speech = utts[1].speech[: max(1, len(utts[1].speech) * 2 // 3)]  # padded batch
    results = run_batch(engine, utts, 1000, plan.steps)
    rows = []
    for u, res in zip(utts, results):
        conditioned, z = served_prompt(u, engine.solving, fm.dev.config.n_feats)
        ref = fm.synthesize(conditioned, on_device=True, estimator=fm.runners["fp32"].estimator, steps=plan.steps,
                            z=z)[0]
        rel, finite = rel_error(torch.from_numpy(res.mel), ref[:, :res.mel.shape[1]])
        ok = rep.check(f"streaming engine on device vs offline, {len(u.speech)} tokens", rel, finite,
                       BOUNDS["streamed"]) and res.mel.shape[1] == 2 * len(u.speech)
        rows.append([len(u.speech), res.mel.shape[1], f"{rel:.2e}", finite, "ok" if ok else "FAIL"])
    rep.add("Streaming engine on the device (what cfm_solver runs) vs offline synthesis",
            "Two utterances of different lengths in one padded batch, one finalising chunk each, estimator fp32 "
            "on the device; z, mu, cond and the Euler loop stay on the device.\n\n"
            + table(["speech tokens", "frames out", "rel. error", "finite", "check"], rows))



def token_chunks(n_tokens: int, first: int, largest: int = 40) -> list[int]:
    """The client's default shape of schedule: a small first chunk, then doubling ones."""
    sizes, size = [], first
    while sum(sizes) < n_tokens:
        sizes.append(min(size, n_tokens - sum(sizes)))
        size = min(2 * size, largest)
    return sizes


def token2wav_section(rep: Report, fm: FlowModes, plan: Plan, clock_cpu: Clock, clock_dev: Clock, seed: int) -> None:
    """token2wav end to end on the device: the streaming engine (what cfm_solver runs) feeding a
    VocoderStream over HiFT in torch on the device (what the gpu target's vocoder model runs)."""
    from s3flow.engine.vocoder_stream import StreamSettings, VocoderStream
    from s3flow.model.vocoder import VocoderConfig, random_vocoder
    from s3flow.runtime.torch_vocoder import TorchVocoder
    from s3flow.model.vocoder_source import offline_vocode

    config = VocoderConfig.full() if plan.size == "full" else VocoderConfig.small()
    hift = random_vocoder(config, seed)
    params = hift.source_params
    cpu, dev = TorchVocoder(hift, "cpu"), TorchVocoder(hift, fm.device)
    hop, rows, data = params.hop_samples, [], {}

    # 1. the vocoder alone: device vs CPU fp32 on the same mel (TF32 off inside TorchVocoder); at least 40
    # tokens, so that the stream below has seams (audio is withheld until 20 frames of lookahead exist)
    u = utterance(dataclasses.replace(plan, speech_tokens=max(plan.speech_tokens, 40)), seed=21)
    mel = fm.synthesize(u, on_device=True, estimator=fm.estimator("fp32"), steps=plan.steps)[0].cpu().numpy()
    set_tf32(False)
    ref, cpu_ms = clock_cpu.run(lambda: offline_vocode(cpu.f0, cpu.decode, mel, params, seed=u.seed))
    out, dev_ms = clock_dev.run(lambda: offline_vocode(dev.f0, dev.decode, mel, params, seed=u.seed))
    rel, finite = tb.rel_l2(out, ref)
    f0_err = float(np.abs(dev.f0(mel[None]) - cpu.f0(mel[None])).max())
    ok = rep.check(f"vocoder ({plan.size}) on {fm.device.type} vs CPU fp32, {mel.shape[1]} frames", rel, finite,
                   BOUNDS["vocoder"]) and f0_err < 1e-6
    audio_s = mel.shape[1] * hop / params.sampling_rate
    rows.append([f"offline vocoding, {mel.shape[1]} frames ({audio_s:.1f} s)", f"{rel:.2e}",
                 f"{np.abs(out - ref).max():.1e} (F0 {f0_err:.1e} Hz)", f"{dev_ms:.1f}", f"{cpu_ms:.1f}",
                 f"{cpu_ms / dev_ms:.1f}x", "ok" if ok else "FAIL"])
    data["vocoder"] = {"rel_error": rel, "max_abs": float(np.abs(out - ref).max()), "f0_hz": f0_err,
                       "ms": dev_ms, "cpu_ms": cpu_ms, "frames": int(mel.shape[1])}
    long_mel = np.tile(mel, (1, 5))
    long_ms = clock_dev.ms(lambda: offline_vocode(dev.f0, dev.decode, long_mel, params, seed=u.seed))
    data["vocoder_long_ms"] = long_ms
    rows.append([f"offline vocoding, {long_mel.shape[1]} frames ({5 * audio_s:.1f} s)", "", "", f"{long_ms:.1f}", "",
                 "", f"{5 * audio_s / long_ms * 1e3:.0f}x RT"])

    # 2. token2wav streamed on the device: mel chunks from the engine, audio chunks from the VocoderStream
    fm.estimator("fp32")
    engine = device_engine(fm, fm.runners["fp32"].estimator)
    stream = VocoderStream(dev.f0, dev.decode, params, StreamSettings(), n_feats=fm.dev.config.n_feats)
    sizes = token_chunks(len(u.speech), first=max(1, plan.speech_tokens // 10))
    state, mels, audio, first_audio_s, at = stream.start(u.seed), [], [], None, 0
    session = SolverSession(engine)
    t0 = time.perf_counter()
    for k, n in enumerate(sizes):
        end = k == len(sizes) - 1
        inputs = request(u, plan.steps, speech=u.speech[at:at + n], start=k == 0)
        [res] = answers(session, [Incoming(7000, start=k == 0, end=end, inputs=inputs)])
        state, chunk = stream.push(state, res.mel, res.frame_offset, end=end)
        if chunk.sample_offset != sum(a.size for a in audio):
            raise AssertionError(f"sample offset {chunk.sample_offset} does not continue {sum(a.size for a in audio)}")
        mels.append(res.mel)
        audio.append(chunk.audio)
        if first_audio_s is None and chunk.audio.size:
            first_audio_s = time.perf_counter() - t0
        at += n
    wall = time.perf_counter() - t0
    streamed_mel, streamed = np.concatenate(mels, axis=1), np.concatenate(audio)
    if sum(a.size > 0 for a in audio) < 2:
        rep.fail("token2wav stream seams", f"only {sum(a.size > 0 for a in audio)} chunk(s) carried audio: no seam")
    frames = 2 * len(u.speech)
    if streamed_mel.shape[1] != frames or streamed.size != hop * frames:
        rep.fail("token2wav streamed sample count",
                 f"{streamed_mel.shape[1]} frames, {streamed.size} samples; want {frames}, {hop * frames}")
    offline_audio = offline_vocode(dev.f0, dev.decode, streamed_mel, params, seed=u.seed)
    rel, finite = tb.rel_l2(streamed, offline_audio)
    ok = rep.check(f"token2wav streamed on {fm.device.type} ({len(sizes)} chunks) vs offline vocoding of its mel",
                   rel, finite, BOUNDS["vocoder-streamed"])
    rtf = wall / (streamed.size / params.sampling_rate)
    rows.append([f"token2wav stream, chunks {sizes} tokens -> samples {[a.size for a in audio]}", f"{rel:.2e}",
                 f"{np.abs(streamed - offline_audio).max():.1e}", f"{1e3 * wall:.1f}", "", f"RTF {rtf:.3f}",
                 "ok" if ok else "FAIL"])
    data["stream"] = {"chunks": sizes, "rel_error": rel, "max_abs": float(np.abs(streamed - offline_audio).max()),
                      "wall_ms": 1e3 * wall, "first_audio_ms": None if first_audio_s is None else 1e3 * first_audio_s,
                      "rtf": rtf, "signal_std": float(offline_audio.std())}
    rep.data["token2wav"] = data
    first = "none" if first_audio_s is None else f"{1e3 * first_audio_s:.0f} ms"
    rep.add("token2wav: the vocoder on the device",
            f"HiFT {plan.size} (seeded random weights) in torch fp32 on {fm.device} (TF32 off): what the gpu "
            f"target's `vocoder` model runs (`vocoder_backend torch`, KIND_GPU). Offline vocoding against the same "
            f"module on the CPU; then token2wav end to end in process: the streaming engine (fp32 estimator, "
            f"{plan.steps} guided steps) feeding the VocoderStream chunk by chunk (20 frames of lookahead), "
            f"against offline vocoding of the streamed mel on the device. Time to first audio {first} "
            f"(computation only, chunks back to back); signal std {offline_audio.std():.3f}.\n\n"
            + table(["what", "rel. error", "max abs", "device ms", "CPU ms", "speed", "check"], rows))


def throughput_section(rep: Report, fm: FlowModes, plan: Plan, clock: Clock, trt_engines: dict) -> None:
    modes = {"fp32": fm.runners["fp32"].estimator, "bf16": fm.runners["bf16"].estimator}
    if "fp16" in trt_engines:
        modes["trt-fp16"] = tb.TrtEstimator(trt_engines["fp16"]["engine"])
    rows, data = [], {}
    audio_s = plan.speech_tokens / TOKENS_PER_SECOND
    for b in plan.batches:
        row = [b]
        for mode, est in modes.items():
            if mode.startswith("trt") and not trt_engines["fp16"]["profile"].covers(2 * b, 2 * (plan.prompt_tokens + plan.speech_tokens)):
                row.append("outside profile")
                continue
            fm.estimator(mode if mode in ("fp32", "bf16") else "fp32")
            engine = device_engine(fm, est)
            utts = [utterance(plan, seed=100 + i) for i in range(b)]
            counter = iter(range(10**6))
            ms = clock.ms(lambda: run_batch(engine, utts, 10_000 * next(counter), plan.steps))
            data[f"B{b}/{mode}"] = ms
            print(f"throughput: batch {b} {mode} {ms:.0f} ms", file=sys.stderr, flush=True)
            row.append(f"{ms:.0f} ms, {b / ms * 1e3:.1f} utt/s, {b * audio_s / ms * 1e3:.0f}x RT")
        rows.append(row)
    rep.data["throughput_ms"] = data
    rep.add("Throughput: streaming engine, one finalising chunk per utterance",
            f"Each utterance {plan.prompt_tokens} prompt + {plan.speech_tokens} speech tokens ({audio_s:.1f} s of "
            f"audio), {plan.steps} guided steps; B utterances in one batch (the estimator sees 2B rows). "
            f"'x RT' = seconds of audio made per second of wall time.\n\n"
            + table(["batch"] + list(modes), rows))



def write_report(rep: Report, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text(rep.markdown())
    (out / "gpu_check.json").write_text(json.dumps(
        {"env": rep.env, "ok": rep.ok, "checks": rep.checks, "data": rep.data}, indent=2, default=str))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="small config, short lengths, batches 1-2")
    p.add_argument("--out", type=Path, default=ROOT / "results", help="results folder (default: %(default)s)")
    p.add_argument("--no-tensorrt", action="store_true", help="skip the TensorRT section")
    p.add_argument("--trt-opt-level", type=int, default=2, help="builder optimisation level (default: %(default)s)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="no further TensorRT build starts after this many seconds (default: %(default)s)")
    p.add_argument("--sections", default="",
                   help="comma-separated sections to run (default: all): precision, streaming, token2wav, tensorrt, "
                        "estimator, throughput, scaling")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch; run with --device cpu --quick for a code-path check",
              file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    rep = Report(device=device.type, plan=plan, env=environment(device))
    rep.env["plan"] = f"{plan.size} config, {'quick' if args.quick else 'full'} run"
    t_start = time.perf_counter()
    config = FlowConfig.small if plan.size == "small" else FlowConfig.full
    set_tf32(False)
    guided = FlowModes(random_flow(config(False), args.seed), device)
    meanflow = FlowModes(random_flow(config(True), args.seed + 1), device)
    clock_dev = Clock(device, plan.warmup, plan.iters)
    clock_cpu = Clock(torch.device("cpu"), 0 if args.quick else 1, 1 if args.quick else 2)

    trt_engines: dict = {}
    sections = [
        ("precision", lambda: precision_section(rep, guided, meanflow, plan, clock_cpu, clock_dev)),
        ("streaming", lambda: streaming_section(rep, guided, plan)),
        ("token2wav", lambda: token2wav_section(rep, guided, plan, clock_cpu, clock_dev, args.seed)),
        ("tensorrt", lambda: trt_engines.update(
            {} if args.no_tensorrt or device.type != "cuda" else
            tensorrt_section(rep, guided, plan, Path(tempfile.mkdtemp(prefix="s3flow_trt_")), args.trt_opt_level,
                             utterance(plan, seed=1), deadline=t_start + args.budget_s - 90))),
        ("estimator", lambda: estimator_section(rep, guided, plan, clock_dev, trt_engines)),
        ("throughput", lambda: throughput_section(rep, guided, plan, clock_dev, trt_engines)),
        ("scaling", lambda: scaling_section(rep, guided, plan, clock_dev)),
    ]
    if device.type != "cuda" and not args.no_tensorrt:
        rep.add("TensorRT", f"Not run: device {device} (engines need a GPU). tensorrt here: "
                f"{tb.tensorrt_version() or 'not importable'}.")
    chosen = {n for n in args.sections.split(",") if n}
    unknown = chosen - {name for name, _ in sections}
    if unknown:
        print(f"unknown --sections {sorted(unknown)}", file=sys.stderr)
        return 2
    for name, run in sections:
        if chosen and name not in chosen:
            continue
        t0 = time.perf_counter()
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - a broken section is a failed check, the rest still runs
            traceback.print_exc()
            rep.fail(f"section {name}", repr(exc))
            rep.add(f"{name}: error", f"```\n{traceback.format_exc()[-2000:]}\n```")
        rep.data.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
        rep.env["wall time"] = f"{time.perf_counter() - t_start:.0f} s"
        write_report(rep, args.out)   # after every section: a run cut short keeps what it measured
    print(f"\n{'PASS' if rep.ok else 'FAIL'}: {sum(c['ok'] for c in rep.checks)}/{len(rep.checks)} checks; "
          f"wrote {args.out / 'gpu_check.md'} and gpu_check.json in {rep.env['wall time']}")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
