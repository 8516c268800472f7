#!/usr/bin/env python3
"""Build the TensorRT engines of a gpu-target model repository on this GPU, check them, install them.

Examples::

    # the repository (configs + ONNX sources), then its engines, on the GPU host that serves them
    python3 scripts/build_repository.py --target gpu --checkpoint /models/s3gen.safetensors --output /repo
    python3 scripts/build_engines.py --repository /repo --checkpoint /models/s3gen.safetensors --cache /engines

    # what would be built, without building (profiles and, where a GPU and TensorRT are here, file names)
    python3 scripts/build_engines.py --repository /repo --dry-run

    # fp32 estimator only, rebuilt even if cached
    python3 scripts/build_engines.py --repository /repo --models estimator --estimator-precision fp32 --rebuild

For ``flow_encoder`` and ``estimator``: build ``<model>/model.onnx`` into a plan named by GPU, TensorRT
version, precision, profile and ONNX digest (``s3flow.runtime.tensorrt.engine_name``) in the cache folder,
unless that exact engine is there; check it against the fp32 reference (the torch module of
``--checkpoint`` on this GPU, else ONNX Runtime on the fp32 ONNX) on random padded inputs: NaN/inf or a
relative L2 error above the bound (fp32 1e-3, fp16 2e-2) fails it; then copy it to
``<model>/1/model.plan`` with ``engine.json`` beside it. ``--estimator-precision auto`` (default) tries
fp16 first and falls back to fp32 when fp16 fails its check. Profiles follow the repository's limits
and batch size (see ``s3flow.runtime.tensorrt``); ``--max-*`` and ``--opt-*`` override them.

``--fallback torch`` (what the container uses): a model whose engine cannot be built or fails its check
is switched, in place, to the torch backend (``s3flow.serving.triton_models.torch_model`` on CUDA, weights from
``--checkpoint``); a later run that builds its engine switches it back. The repository's configs always
say which backend each model runs on, and this run's summary lists them.

Exit status: 0 when every model is served (a checked engine installed, or the torch fallback); 1 when a
model is left without either; 2 when this host has no TensorRT (no ``tensorrt`` package, no ``trtexec``)
or no GPU and there is no fallback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from s3flow.runtime import tensorrt as tb
from s3flow.runtime.torch_runner import DEFAULT_ESTIMATOR_DTYPE
from s3flow.repository.backends import read_served_shapes, set_backend as _set_backend


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, default=ROOT / "model_repository",
                   help="gpu-target repository from build_repository.py (default: %(default)s)")
    p.add_argument("--cache", type=Path, help="engine cache folder (default: <repository>/../engines)")
    p.add_argument("--checkpoint", type=Path, help="the checkpoint the repository was built from: parity "
                   "reference in torch fp32 (default: ONNX Runtime on the fp32 ONNX)")
    p.add_argument("--models", nargs="+", choices=tb.MODELS, default=list(tb.MODELS))
    b = p.add_argument_group("build")
    b.add_argument("--estimator-precision", choices=["auto", "fp16", "fp32"], default="auto",
                   help="auto: fp16, or fp32 if fp16 fails its check (default: %(default)s)")
    b.add_argument("--encoder-precision", choices=["auto", "fp16", "fp32"], default="fp32",
                   help="the encoder is ~2%% of the FLOPs (default: %(default)s)")
    b.add_argument("--tool", choices=["auto", "python", "trtexec"], default="auto",
                   help="TensorRT Python API or trtexec (default: %(default)s: the API if importable)")
    b.add_argument("--workspace-mb", type=int, default=8192, help="(default: %(default)s)")
    b.add_argument("--opt-level", type=int, default=3, help="builder optimisation level 0-5 (default: %(default)s)")
    b.add_argument("--device", type=int, default=0, help="CUDA device (default: %(default)s)")
    b.add_argument("--rebuild", action="store_true", help="rebuild even if the cache has the engine")
    b.add_argument("--no-check", action="store_true", help="skip the parity check (not recommended)")
    b.add_argument("--dry-run", action="store_true", help="print profiles and names, build nothing")
    b.add_argument("--fallback", choices=["none", "torch"], default="none",
                   help="torch: serve a model whose engine fails with the torch backend (default: %(default)s)")
    b.add_argument("--torch-dtype", choices=["fp32", "bf16", "fp16"], default=DEFAULT_ESTIMATOR_DTYPE,
                   help="the fallback estimator's dtype (default: %(default)s)")
    s = p.add_argument_group("profile overrides (default: from the repository's limits)")
    s.add_argument("--max-batch", type=int, help="utterances per solver batch (estimator gets 2x when guided)")
    s.add_argument("--max-frames", type=int, help="estimator frames, prompt included")
    s.add_argument("--max-tokens", type=int, help="encoder tokens, prompt included")
    s.add_argument("--opt-frames", type=int, default=300, help="(default: %(default)s)")
    s.add_argument("--opt-tokens", type=int, default=150, help="(default: %(default)s)")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def profiles(args) -> dict:
    st = read_served_shapes(args.repository)
    batch = args.max_batch or st.max_batch
    return {"estimator": tb.estimator_profile(st.n_feats, st.meanflow, batch,
                                              args.max_frames or tb.max_frames(st),
                                              opt_frames=args.opt_frames),
            "flow_encoder": tb.encoder_profile(batch, args.max_tokens or tb.max_tokens(st),
                                               opt_tokens=args.opt_tokens, n_feats=st.n_feats)}


def references(args) -> dict:
    """model -> its fp32 reference: a callable taking torch tensors by input name and returning them by output
    name (the torch modules of --checkpoint on this GPU, TF32 off; else ONNX Runtime on the fp32 ONNX)."""
    if args.checkpoint is None:
        return {model: tb.onnxruntime_engine(args.repository / model / "model.onnx") for model in tb.MODELS}
    import torch

    from s3flow.model.checkpoint import load_flow
    from s3flow.runtime.torch_runner import TorchRunner

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    flow = load_flow(args.checkpoint)
    dev = f"cuda:{args.device}"
    return {"estimator": TorchRunner(flow.estimator, "estimator", dev),
            "flow_encoder": TorchRunner(flow.encoder, "flow_encoder", dev)}


def precisions(choice: str) -> list[str]:
    return ["fp16", "fp32"] if choice == "auto" else [choice]


def build_one(model: str, args, profile, toolchain, reference) -> tuple[bool, str]:
    onnx_path = args.repository / model / "model.onnx"
    if not onnx_path.is_file():
        return False, f"{onnx_path} not found (build the repository with --target gpu)"
    choice = args.estimator_precision if model == "estimator" else args.encoder_precision
    notes = []
    for precision in precisions(choice):
        try:
            res = tb.build_engine(onnx_path, args.cache, profile, precision, toolchain=toolchain,
                                  workspace_mb=args.workspace_mb, opt_level=args.opt_level, device=args.device,
                                  rebuild=args.rebuild)
        except tb.EngineBuildError as exc:
            notes.append(f"{precision}: build failed: {exc}")
            continue
        sidecar = res.path.with_suffix(".json")
        parity = []
        if res.cached and sidecar.is_file() and not args.rebuild:
            record = json.loads(sidecar.read_text())
            ok = record.get("ok", False)
            parity = [tb.Parity(**p) for p in record.get("parity", [])]
            verdict = "passed" if ok else "failed"
            print(f"{model}: cached {res.name} ({verdict} its check when built)")
        elif args.no_check:
            ok = True
        else:
            engine = tb.TrtEngine(res.path, args.device)
            parity = tb.check_engine(engine, reference, profile, precision)
            del engine
            ok = all(p.ok for p in parity)
            for p in parity:
                print(f"  {p.describe()}")
            sidecar.write_text(json.dumps({"ok": ok, "parity": [dataclasses.asdict(p) for p in parity],
                                           "build_s": res.seconds, "tool": res.tool,
                                           "checked_at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
        if ok:
            target = tb.install_engine(res, args.repository, model, parity)
            return True, f"{res.name} -> {target}" + (f" (after: {'; '.join(notes)})" if notes else "")
        notes.append(f"{precision}: failed its parity check")
    return False, "; ".join(notes)


def set_backend(repository: Path, model: str, backend: str, checkpoint=None,
                dtype: str = DEFAULT_ESTIMATOR_DTYPE) -> None:
    try:
        print(_set_backend(repository, model, backend, checkpoint, dtype))
    except ValueError as exc:
        raise SystemExit(f"{exc} (--checkpoint)") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    args.cache = args.cache or args.repository.resolve().parent / "engines"
    profs = profiles(args)
    for model in args.models:
        print(f"{model}: profile {profs[model].tag()}  shapes {profs[model].input_shapes()}")
    try:
        toolchain = tb.find_toolchain(args.tool)
        gpu, cc = tb.gpu_identity(args.device)
    except tb.EngineBuildError as exc:
        print(f"cannot build engines here: {exc}", file=sys.stderr)
        if args.fallback == "torch" and not args.dry_run:
            for model in args.models:
                set_backend(args.repository, model, "torch", args.checkpoint, args.torch_dtype)
            return 0
        return 2
    print(f"GPU {gpu} (sm{cc[0]}{cc[1]}), TensorRT {toolchain.version} via {toolchain.tool}, cache {args.cache}")
    if args.dry_run:
        for model in args.models:
            digest = tb.file_digest(args.repository / model / "model.onnx")
            for precision in precisions(args.estimator_precision if model == "estimator" else args.encoder_precision):
                print("  " + tb.engine_name(model, gpu=gpu, compute_capability=cc, trt_version=toolchain.version,
                                            precision=precision, profile=profs[model], source_digest=digest))
        return 0
    reference = {} if args.no_check else references(args)
    failed = 0
    for model in args.models:
        t0 = time.perf_counter()
        ok, what = build_one(model, args, profs[model], toolchain, reference.get(model))
        print(f"{model}: {'OK' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s: {what}")
        if ok:
            set_backend(args.repository, model, "tensorrt")
        elif args.fallback == "torch":
            set_backend(args.repository, model, "torch", args.checkpoint, args.torch_dtype)
        else:
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
