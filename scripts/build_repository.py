#!/usr/bin/env python3
"""Build the Triton model repository from a checkpoint, or from seeded random weights.

Examples::

    # a real Chatterbox checkpoint (s3gen.safetensors or s3gen.pt; meanflow is detected)
    .venv/bin/python scripts/build_repository.py --checkpoint ~/models/s3gen.safetensors

    # seeded random weights in the checkpoint's exact layout, small config, 4 solver instances
    .venv/bin/python scripts/build_repository.py --size small --seed 0 --solver-instances 4

    # configs for a GPU host (TensorRT plans are built there by scripts/build_engines.py)
    .venv/bin/python scripts/build_repository.py --target gpu

It writes model_repository/{token2mel,cfm_solver,flow_encoder,estimator}, exports ONNX, checks the
exports against torch, and prints what it made. Exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backend"))  # fallback when the package is not installed

from s3flow.checkpoint import load_flow, write_random_checkpoint  # noqa: E402
from s3flow.flow import FlowConfig  # noqa: E402
from s3flow.protocol import Limits  # noqa: E402
from s3flow.repository import Batching, RepositorySettings, write_repository  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("weights")
    w.add_argument("--checkpoint", type=Path, help="S3Gen checkpoint (.safetensors or .pt); default: "
                   "seeded random weights written to <output>/../checkpoints/")
    w.add_argument("--size", choices=["full", "small"], default="full", help="random weights' size (default: full)")
    w.add_argument("--meanflow", action="store_true", help="random weights: a meanflow (Turbo) model")
    w.add_argument("--seed", type=int, default=0, help="random weights' seed (default: 0)")
    o = p.add_argument_group("output")
    o.add_argument("--output", type=Path, default=ROOT / "model_repository", help="(default: %(default)s)")
    o.add_argument("--target", choices=["cpu", "gpu"], default="cpu", help="(default: %(default)s)")
    o.add_argument("--no-check", action="store_true", help="skip the ONNX Runtime vs torch check")
    b = p.add_argument_group("batching")
    d = Batching()
    b.add_argument("--strategy", choices=["oldest", "direct"], default=d.strategy)
    b.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    b.add_argument("--preferred-batch-sizes", type=int, nargs="*", default=list(d.preferred_batch_sizes))
    b.add_argument("--max-queue-delay-us", type=int, default=d.max_queue_delay_us)
    b.add_argument("--max-candidate-sequences", type=int, default=d.max_candidate_sequences)
    b.add_argument("--solver-instances", type=int, default=d.solver_instances)
    b.add_argument("--estimator-instances", type=int, default=d.estimator_instances)
    b.add_argument("--ort-threads", type=int, default=0, help="ONNX Runtime threads (0: all cores)")
    lim = p.add_argument_group("limits and defaults (cfm_solver parameters)")
    for name, value in vars(Limits()).items():
        lim.add_argument("--" + name.replace("_", "-"), type=type(value), default=value,
                         help="(default: %(default)s)")
    return p.parse_args(argv)


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
    limits = Limits(**{k: getattr(args, k) for k in vars(Limits())})
    batching = Batching(strategy=args.strategy, max_batch_size=args.max_batch_size,
                        preferred_batch_sizes=tuple(args.preferred_batch_sizes),
                        max_queue_delay_us=args.max_queue_delay_us,
                        max_candidate_sequences=args.max_candidate_sequences,
                        solver_instances=args.solver_instances, estimator_instances=args.estimator_instances)
    settings = RepositorySettings(target=args.target, limits=limits, batching=batching, ort_threads=args.ort_threads)
    summary = write_repository(args.output, flow, settings)
    print(summary.describe())
    if not args.no_check:
        from s3flow.onnx_export import check_encoder_onnx, check_estimator_onnx
        sub = "1" if args.target == "cpu" else "."
        err_e = check_estimator_onnx(flow.estimator, args.output / "estimator" / sub / "model.onnx")
        err_c = check_encoder_onnx(flow.encoder, args.output / "flow_encoder" / sub / "model.onnx")
        print(f"ONNX Runtime vs torch, worst abs error: estimator {err_e:.2e}, encoder {err_c:.2e}")
        if not (err_e < 1e-3 and err_c < 1e-3):
            print("ONNX check FAILED", file=sys.stderr)
            return 1
    print(f"checkpoint {ckpt}; done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
