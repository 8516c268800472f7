"""Build the Triton model repository from a checkpoint, or from seeded random weights (the command line of
``scripts/build_repository.py``; ``main(argv)`` for other tools).

Examples::

    # a real Chatterbox checkpoint (s3gen.safetensors or s3gen.pt; meanflow is detected)
    .venv/bin/python scripts/build_repository.py --checkpoint ~/models/s3gen.safetensors

    # seeded random weights in the checkpoint's exact layout, small config, 4 solver instances
    .venv/bin/python scripts/build_repository.py --size small --seed 0 --solver-instances 4

    # configs for a GPU host (TensorRT plans are built there by scripts/build_engines.py; the vocoder runs
    # HiFT in torch on the GPU, --vocoder-backend onnx keeps it in ONNX Runtime on the CPU)
    .venv/bin/python scripts/build_repository.py --target gpu

    # a GPU host without TensorRT: the estimator and encoder as torch on CUDA (the estimator under fp32,
    # bf16 (the default) or fp16 autocast)
    .venv/bin/python scripts/build_repository.py --target gpu --gpu-backend torch --torch-dtype fp16

    # mel only (no token2wav / vocoder)
    .venv/bin/python scripts/build_repository.py --no-vocoder

It writes model_repository/{token2mel,cfm_solver,flow_encoder,estimator} and, unless --no-vocoder,
{token2wav,vocoder} (the HiFT vocoder from the checkpoint's mel2wav.* tensors, or seeded random weights of
the flow's size where the checkpoint has none), exports ONNX, checks the exports against torch, and prints what it made. Exits non-zero
on any failure.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.engine.settings import SolverSettings
from s3flow.runtime.torch_runner import DEFAULT_ESTIMATOR_DTYPE, DTYPES
from s3flow.engine.vocoder_stream import SERVED_FIRST_LOOKAHEAD_FRAMES, StreamSettings
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import (DEFAULT_INSTANCES, DEFAULT_SOLVING, SCHEDULING, Batching, RepositorySettings,
                                       TRITON_IDLE_GRACE_S, VoiceSettings)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("weights")
    w.add_argument("--checkpoint", type=Path, help="S3Gen checkpoint (.safetensors or .pt); default: "
                   "seeded random weights written to <output>/../checkpoints/")
    w.add_argument("--size", choices=["full", "small"], default="full", help="random weights' size (default: full)")
    w.add_argument("--meanflow", action="store_true", help="random weights: a meanflow (Turbo) model")
    w.add_argument("--seed", type=int, default=0, help="random weights' seed (default: 0)")
    v = p.add_argument_group("vocoder (token2wav)")
    v.add_argument("--vocoder", action=argparse.BooleanOptionalAction, default=True,
                   help="write token2wav and the vocoder (default: on)")
    v.add_argument("--vocoder-checkpoint", type=Path, help="file with the mel2wav.* tensors (default: "
                   "--checkpoint; seeded random weights when neither is given)")
    v.add_argument("--vocoder-backend", choices=["auto", "onnx", "torch"], default="auto",
                   help="how the vocoder model runs HiFT: onnx (ONNX Runtime, CPU) or torch (on the GPU for "
                        "--target gpu, else the CPU); auto: torch for --target gpu, onnx for cpu (default: %(default)s)")
    v.add_argument("--vocoder-lookahead-frames", type=int, default=StreamSettings().lookahead_frames,
                   help="mel frames of audio held back for the right context; 20 streams exactly, fewer "
                        "lowers latency (default: %(default)s)")
    v.add_argument("--vocoder-first-lookahead-frames", type=int, default=SERVED_FIRST_LOOKAHEAD_FRAMES,
                   help="the first response's lookahead (-1: the same); fewer lets the first mel chunk carry "
                        "audio, cross-faded into the exact stream by the next response (default: %(default)s)")
    vo = p.add_argument_group("voices (voice_encoder and the voice registry)")
    vs = VoiceSettings()
    vo.add_argument("--voice", action=argparse.BooleanOptionalAction, default=True,
                    help="write voice_encoder when the checkpoint holds tokenizer.* and speaker_encoder.* "
                         "(seeded random weights always do) (default: on)")
    vo.add_argument("--voice-checkpoint", type=Path, help="file with the tokenizer.* and speaker_encoder.* "
                    "tensors (default: --checkpoint)")
    vo.add_argument("--voice-dir", default=vs.voice_dir, help="where registered voices live; empty: a folder "
                    "per server run, gone at restart (default: empty)")
    vo.add_argument("--max-voices", type=int, default=vs.max_voices, help="(default: %(default)s)")
    vo.add_argument("--max-voice-bytes", type=int, default=vs.max_voice_bytes, help="(default: %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--output", type=Path, default=Path("model_repository"), help="(default: %(default)s, in the "
                   "current folder)")
    o.add_argument("--target", choices=["cpu", "gpu"], default="cpu", help="(default: %(default)s)")
    o.add_argument("--gpu-backend", choices=["tensorrt", "torch"], default="tensorrt",
                   help="gpu target: TensorRT plans (scripts/build_engines.py) or torch on CUDA (default: %(default)s)")
    o.add_argument("--torch-dtype", choices=sorted(DTYPES), default=DEFAULT_ESTIMATOR_DTYPE,
                   help="--gpu-backend torch: the estimator's compute dtype (default: %(default)s)")
    o.add_argument("--no-check", action="store_true", help="skip the ONNX Runtime vs torch check")
    b = p.add_argument_group("batching")
    d = Batching()
    b.add_argument("--strategy", choices=["oldest", "direct"], default=d.strategy)
    b.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    b.add_argument("--preferred-batch-sizes", type=int, nargs="*", default=list(d.preferred_batch_sizes))
    b.add_argument("--max-queue-delay-us", type=int, default=d.max_queue_delay_us)
    b.add_argument("--max-candidate-sequences", type=int, default=d.max_candidate_sequences)
    b.add_argument("--triton-idle-grace-s", type=float, default=None,
                   help="seconds Triton keeps an idle sequence after the models' --idle-timeout-s; it counts a "
                        "computing chunk as idle, so it must exceed the longest chunk (default: "
                        + ", ".join(f"{k} {v:g}" for k, v in TRITON_IDLE_GRACE_S.items()) + ")")
    b.add_argument("--admission", action=argparse.BooleanOptionalAction, default=True,
                   help="the ensembles' admission step ahead of the solver: a refused START takes no sequence "
                        "slot (s3flow.serving.admission) (default: on)")
    b.add_argument("--admission-batching", action=argparse.BooleanOptionalAction, default=d.admission_batching,
                   help="admission takes the requests queued for it in one execute (Triton's dynamic batcher, no "
                        "delay; results/refusals.md: no sooner for a refused burst) (default: off)")
    b.add_argument("--scheduling", choices=SCHEDULING, default="fifo",
                   help="fifo: Triton batches whole chunks; deadline: the solver steps the chunks of many "
                        "streams one Euler step at a time, the closest to running dry first (default: %(default)s)")
    layouts = "; ".join(f"{t} {v['solver_instances']} and {v['estimator_instances']}"
                        for t, v in DEFAULT_INSTANCES.items())
    b.add_argument("--solver-instances", type=int, default=d.solver_instances,
                   help=f"(default: the target's; solver and estimator instances: {layouts}; results/layout.md)")
    b.add_argument("--estimator-instances", type=int, default=d.estimator_instances,
                   help="(default: the target's, as above)")
    b.add_argument("--encoder-instances", type=int, default=d.encoder_instances,
                   help="flow_encoder's instances (default: %(default)s)")
    b.add_argument("--ort-threads", type=int, default=0,
                   help="ONNX Runtime threads per instance (0: the cores divided among the model's instances)")
    b.add_argument("--encoder-spinning", action="store_true",
                   help="cpu target: let the flow encoder's idle ONNX Runtime threads spin for work (off by default: "
                        "results/encoder_spinning.md)")
    b.add_argument("--vocoder-spinning", action="store_true",
                   help="cpu target: the same for the vocoder's ONNX Runtime sessions (off by default: "
                        "results/vocoder_spinning.md)")
    lim = p.add_argument_group("request rules, sequence limits, admission target, chunk solving and deadlines "
                               "(cfm_solver parameters; s3flow.engine.settings)")
    for name, value in SolverSettings.names().items():
        if any(name in v for v in DEFAULT_SOLVING.values()):   # None: the target's (solver_flags)
            shown = ", ".join(f"{t} {DEFAULT_SOLVING[t].get(name, value)}" for t in DEFAULT_SOLVING)
            lim.add_argument("--" + name.replace("_", "-"), type=type(value), default=None,
                             help=f"(default: the target's: {shown})")
        else:
            lim.add_argument("--" + name.replace("_", "-"), type=type(value), default=value,
                             help="(default: %(default)s)")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def solver_flags(args: argparse.Namespace) -> dict:
    """The solver's settings by flat name: the flags given, the target's (``DEFAULT_SOLVING``) for those left
    open, the settings' own defaults for the rest. The target's ``keep_solved`` holds only where it can: with
    prefix mode or a sliding prompt named, nothing is kept."""
    flat = {k: getattr(args, k) for k in SolverSettings.names()}
    mine, defaults = DEFAULT_SOLVING.get(args.target, {}), SolverSettings.names()
    left_open = {k for k, v in flat.items() if v is None}
    for k in left_open - {"keep_solved"}:
        flat[k] = mine.get(k, defaults[k])
    if "keep_solved" in left_open:
        kept = mine.get("keep_solved", defaults["keep_solved"])
        flat["keep_solved"] = kept if flat["context_frames"] >= 0 and not flat["slide_prompt"] else 0
    return flat


def settings_of(args: argparse.Namespace) -> RepositorySettings:
    """The repository's settings from its flags (what ``main`` builds; the simulator builds its server from them)."""
    solver = SolverSettings.of(**solver_flags(args))
    batching = Batching(strategy=args.strategy, max_batch_size=args.max_batch_size,
                        preferred_batch_sizes=tuple(args.preferred_batch_sizes),
                        max_queue_delay_us=args.max_queue_delay_us,
                        max_candidate_sequences=args.max_candidate_sequences,
                        solver_instances=args.solver_instances, estimator_instances=args.estimator_instances,
                        encoder_instances=args.encoder_instances, admission_batching=args.admission_batching)
    return RepositorySettings(target=args.target, solver=solver, batching=batching, ort_threads=args.ort_threads,
                              encoder_spinning=args.encoder_spinning, vocoder_spinning=args.vocoder_spinning,
                              gpu_backend=args.gpu_backend, torch_dtype=args.torch_dtype, scheduling=args.scheduling,
                              vocoder_backend=args.vocoder_backend, triton_idle_grace_s=args.triton_idle_grace_s,
                              voices=VoiceSettings(args.voice_dir, args.max_voices, args.max_voice_bytes),
                              admission=args.admission)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.checkpoint is None:
        config = FlowConfig.full(args.meanflow) if args.size == "full" else FlowConfig.small(args.meanflow)
        name = f"s3gen_random_{args.size}{'_meanflow' if args.meanflow else ''}_seed{args.seed}.safetensors"
        ckpt = args.output.resolve().parent / "checkpoints" / name
        write_random_checkpoint(ckpt, config, seed=args.seed)
        print(f"wrote seeded random checkpoint {ckpt}")
    else:
        ckpt = args.checkpoint
    flow = load_flow(ckpt)
    settings = settings_of(args)
    voice_ckpt = None
    if args.voice:
        from s3flow.model.checkpoint_io import read_tensors
        from s3flow.model.voice.weights import SPEAKER_PREFIX, TOKENIZER_PREFIX
        voice_ckpt = args.voice_checkpoint or ckpt
        try:
            read_tensors(voice_ckpt, TOKENIZER_PREFIX)
            read_tensors(voice_ckpt, SPEAKER_PREFIX)
        except ValueError:
            if args.voice_checkpoint is not None:
                raise
            print(f"{voice_ckpt} holds no tokenizer.* / speaker_encoder.* tensors: no voice_encoder "
                  f"(give --voice-checkpoint to add one)")
            voice_ckpt = None
    hift, voc_ckpt, voc_settings = None, None, None
    if args.vocoder:
        from s3flow.model.checkpoint_io import read_tensors
        from s3flow.model.vocoder import VOCODER_PREFIX, VocoderConfig, load_vocoder, write_random_vocoder_checkpoint
        voc_ckpt = args.vocoder_checkpoint
        if voc_ckpt is None and args.checkpoint is not None:
            try:  # an S3Gen checkpoint holds mel2wav.* beside flow.*; a flow-only file does not
                read_tensors(args.checkpoint, VOCODER_PREFIX)
                voc_ckpt = args.checkpoint
            except ValueError:
                print(f"{args.checkpoint} holds no mel2wav.* tensors: the vocoder gets seeded random weights")
        if voc_ckpt is None:
            small = flow.config.to_dict() != FlowConfig.full(flow.config.meanflow).to_dict()
            size = "small" if (small if args.checkpoint is not None else args.size == "small") else "full"
            voc_ckpt = (args.output.resolve().parent / "checkpoints" / f"hift_random_{size}_seed{args.seed}.safetensors")
            write_random_vocoder_checkpoint(voc_ckpt, VocoderConfig.small() if size == "small" else VocoderConfig.full(),
                                            seed=args.seed)
            print(f"wrote seeded random vocoder checkpoint {voc_ckpt}")
        hift = load_vocoder(voc_ckpt)
        voc_settings = StreamSettings(lookahead_frames=args.vocoder_lookahead_frames,
                                      first_lookahead_frames=args.vocoder_first_lookahead_frames)
    summary = write_repository(args.output, flow, settings, vocoder=hift,
                               vocoder_settings=voc_settings, voice_checkpoint=voice_ckpt)
    print(summary.describe())
    if not args.no_check:
        from s3flow.runtime.onnx_export import check_encoder_onnx, check_estimator_onnx
        sub = "1" if args.target == "cpu" else "."
        err_e = check_estimator_onnx(flow.estimator, args.output / "estimator" / sub / "model.onnx")
        err_c = check_encoder_onnx(flow.encoder, args.output / "flow_encoder" / sub / "model.onnx")
        print(f"ONNX Runtime vs torch, worst abs error: estimator {err_e:.2e}, encoder {err_c:.2e}")
        if not (err_e < 1e-3 and err_c < 1e-3):
            print("ONNX check FAILED", file=sys.stderr)
            return 1
        if hift is not None and (args.output / "vocoder" / "1" / "f0.onnx").is_file():  # torch backend: no graphs
            from s3flow.runtime.vocoder import check_vocoder_onnx
            err = check_vocoder_onnx(hift, args.output / "vocoder" / "1")
            print(f"ONNX Runtime vs torch, vocoder: audio {err['audio']:.2e} (rms {err['audio_rms']:.2e}), "
                  f"f0 {err['f0']:.2e} Hz")
            if not (err["audio"] < 1e-4 and err["f0"] < 1e-6):
                print("vocoder ONNX check FAILED", file=sys.stderr)
                return 1
    if voc_ckpt is not None:
        print(f"vocoder checkpoint {voc_ckpt}")
    print(f"checkpoint {ckpt}; done in {time.perf_counter() - t0:.1f} s")
    return 0
