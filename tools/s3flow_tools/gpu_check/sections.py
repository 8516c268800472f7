"""The sections of a device check that need only the model and runtime layers: the whole flow's precision
per estimator mode, the estimator's forward time, and TensorRT engines (build, parity, time).
scripts/gpu_check.py runs them beside its streaming sections."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from s3flow_contract.tensors import TOKENS_PER_SECOND
from s3flow.runtime import tensorrt as tb
from s3flow_tools.gpu_check.flows import FlowModes, Plan, Utterance, flops, set_tf32, utterance
from s3flow_tools.gpu_check.report import BOUNDS, Clock, Report, rel_error, table
from s3flow.runtime.torch_runner import TorchRunner


def precision_section(rep: Report, guided: FlowModes, meanflow: FlowModes, plan: Plan, clock_cpu: Clock,
                      clock_dev: Clock) -> None:
    u = utterance(plan, seed=1)
    rows, data = [], {}
    for label, fm, steps in ((f"guided, {plan.steps} steps", guided, plan.steps), ("meanflow, 2 steps", meanflow, 2)):
        ref, cpu_ms = clock_cpu.run(lambda: fm.synthesize(u, on_device=False, steps=steps))
        modes = ("fp32", "tf32", "bf16", "fp16", "half") if fm.device.type == "cuda" else ("fp32", "bf16", "fp16")
        for mode in modes:
            est = fm.estimator(mode)
            try:
                out, dev_ms = clock_dev.run(lambda: fm.synthesize(u, on_device=True, estimator=est, steps=steps))
                rel, finite = rel_error(out, ref)
            except Exception as exc:  # noqa: BLE001 - reported, and a failed check unless informational
                if mode != "half":
                    rep.fail(f"{label} {mode}", repr(exc))
                rows.append([label, mode, "error", "", "", "", repr(exc)[:80]])
                continue
            verdict = "info" if mode == "half" else ("ok" if rep.check(f"whole flow {label}, {mode} vs CPU fp32",
                                                                       rel, finite, BOUNDS[mode]) else "FAIL")
            rows.append([label, mode, f"{rel:.2e}", finite, f"{dev_ms:.1f}", f"{cpu_ms / dev_ms:.1f}x", verdict])
            data[f"{label}/{mode}"] = {"rel_error": rel, "finite": finite, "ms": dev_ms, "cpu_ms": cpu_ms}
        rows.append([label, "CPU fp32 (reference)", "0", True, f"{cpu_ms:.1f}", "1.0x", "reference"])
    set_tf32(False)
    rep.data["whole_flow"] = data
    rep.add("Whole flow: device modes vs CPU fp32 (precision and time, side by side)",
            f"{plan.prompt_tokens} prompt + {plan.speech_tokens} speech tokens "
            f"({plan.speech_tokens / TOKENS_PER_SECOND:.1f} s of audio); encoder fp32 in every mode; time = median "
            f"wall time of the whole synthesis (encoder + solve); 'half' = plain module.half(), information only.\n\n"
            + table(["model", "estimator mode", "rel. error", "finite", "ms", "vs CPU", "check"], rows))


def estimator_section(rep: Report, fm: FlowModes, plan: Plan, clock: Clock, trt_engines: dict) -> None:
    cfg = fm.dev.estimator.config
    rows, data = [], {}
    from s3flow.model.solver import EstimatorInputs
    from s3flow.runtime.onnx_export import make_estimator_inputs
    modes = (["fp32", "tf32"] if fm.device.type == "cuda" else ["fp32"]) + ["bf16", "fp16"]
    modes += [f"trt-{p}" for p in trt_engines]
    for t in plan.frames:
        inputs = make_estimator_inputs(fm.dev.estimator, batch=2, frames=t, seed=t)
        gf = flops(cfg, 2, t)
        row = [t, f"{gf / 1e9:.3g}" if gf else "n/a"]
        for mode in modes:
            if mode.startswith("trt-"):
                engine = trt_engines[mode[4:]]
                if not engine["profile"].covers(2, t):
                    row.append("outside profile")
                    continue
                fn = (lambda e=engine["engine"]: e(**inputs))
            else:
                est = fm.estimator(mode)
                fn = (lambda e=est: e(EstimatorInputs(**inputs)))
            ms = clock.ms(fn)
            data[f"T{t}/{mode}"] = ms
            row.append(f"{ms:.2f}" + (f" ({gf / ms / 1e9:.3g})" if gf else ""))
        rows.append(row)
    set_tf32(False)
    rep.data["estimator_ms"] = data
    rep.add("Estimator forward, B = 2 (one guided utterance)",
            "ms per call (median), and in brackets TFLOP/s from the analytic count (s3flow.model.flops; matrix "
            "products only).\n\n" + table(["T", "GFLOP"] + modes, rows))


def tensorrt_section(rep: Report, fm: FlowModes, plan: Plan, workdir: Path, opt_level: int,
                     precision_utt: Utterance, deadline: float = float("inf")) -> dict:
    """Build, check and return {precision: {"engine", "profile"}}; {} when TensorRT is not here."""
    version = tb.tensorrt_version()
    if version is None:
        rep.add("TensorRT", "Not run: the `tensorrt` Python package is not importable on this host "
                f"(trtexec: {tb.find_trtexec() or 'not found'}). No engine was built or checked; in the "
                "container (docker/) the package matching Triton's TensorRT is installed and "
                "scripts/build_engines.py builds the served engines.")
        return {}
    try:
        import onnx  # noqa: F401
    except ImportError:
        rep.add("TensorRT", f"TensorRT {version} is importable but onnx is not: no ONNX export, no engine.")
        return {}
    from s3flow.runtime.onnx_export import export_encoder, export_estimator

    t0 = time.perf_counter()
    export_estimator(fm.cpu.estimator, workdir / "estimator" / "model.onnx")
    export_encoder(fm.cpu.encoder, workdir / "flow_encoder" / "model.onnx")
    export_s = time.perf_counter() - t0
    n_feats = fm.cpu.config.n_feats
    est_prof = tb.estimator_profile(n_feats, False, plan.trt_max_batch, plan.trt_max_frames,
                                    opt_frames=min(300, plan.trt_max_frames))
    enc_prof = tb.encoder_profile(plan.trt_max_batch, plan.trt_max_frames // 2,
                                  opt_tokens=min(150, plan.trt_max_frames // 2))
    set_tf32(False)
    references = {"estimator": fm.runners["fp32"],  # fp32 references on the device: engines and runners alike
                  "flow_encoder": TorchRunner(fm.dev.encoder, "flow_encoder", fm.device)}
    rows, engines = [], {}
    for model, precision, prof in (("estimator", "fp16", est_prof), ("flow_encoder", "fp32", enc_prof),
                                   ("estimator", "fp32", est_prof)):
        if time.perf_counter() > deadline:  # keep the whole check inside its time budget
            rows.append([model, precision, prof.tag(), "-", "-", "skipped: time budget (--budget-s)", "-"])
            continue
        try:
            res = tb.build_engine(workdir / model / "model.onnx", workdir / "engines", prof, precision,
                                  opt_level=opt_level, device=fm.device.index or 0)
            engine = tb.TrtEngine(res.path, fm.device.index or 0)
            parity = tb.check_engine(engine, references[model], prof, precision)
            if model == "estimator":
                engines[precision] = {"engine": engine, "profile": prof}
            for p in parity:
                rep.check(f"TensorRT {p.what}", p.rel_error, p.finite, p.bound)
            rows.append([model, precision, prof.tag(), f"{res.seconds:.0f}", f"{res.path.stat().st_size / 1e6:.0f}",
                         "; ".join(f"{p.rel_error:.1e}" for p in parity), "ok" if all(p.ok for p in parity) else "FAIL"])
        except Exception as exc:  # noqa: BLE001
            rep.fail(f"TensorRT {model} {precision}", repr(exc))
            rows.append([model, precision, prof.tag(), "-", "-", repr(exc)[:100], "FAIL"])
    body = (f"TensorRT {version}; ONNX export {export_s:.0f} s; builder optimisation level {opt_level}; "
            "narrow profiles for the check's time budget (the served engines use the repository's limits).\n\n"
            + table(["model", "precision", "profile", "build s", "MB", "parity rel. errors", "check"], rows))
    if "fp16" in engines:  # the whole guided flow on the fp16 engine, vs CPU fp32
        ref = fm.synthesize(precision_utt, on_device=False, steps=plan.steps)
        est = tb.TrtEstimator(engines["fp16"]["engine"])
        out = fm.synthesize(precision_utt, on_device=True, estimator=est, steps=plan.steps)
        rel, finite = rel_error(out, ref)
        ok = rep.check(f"whole flow guided, {plan.steps} steps, TensorRT fp16 vs CPU fp32", rel, finite, BOUNDS["trt-fp16"])
        body += f"\n\nWhole guided flow on the fp16 engine vs CPU fp32: rel. error {rel:.2e}, finite {finite} " \
                f"({'ok' if ok else 'FAIL'})."
    rep.add("TensorRT", body)
    return engines


# ---------------------------------------------------------------------------------------------------



def scaling_section(rep: Report, fm: FlowModes, plan: Plan, clock: Clock) -> None:
    """Per-call time of the estimator against its rows and frames, and of the encoder against its batch: the
    figures a projection of many streams on one device needs (s3flow_tools' simulator reads them from the
    json). Eager torch per mode, and a CUDA graph of the bf16 call (what a TensorRT engine's launch floor is
    closer to than eager's hundreds of kernel launches). Information only: no check fails here."""
    import torch

    from s3flow.model.solver import EstimatorInputs
    from s3flow.runtime.onnx_export import make_estimator_inputs
    cuda = fm.device.type == "cuda"
    modes = ["tf32", "bf16", "fp16"] if cuda else ["fp32"]
    data: dict = {"estimator_ms": {}, "graph_bf16_ms": {}, "encoder_ms": {}, "peak_mib": {}}
    rows = []
    for t in plan.scale_frames:
        for r in plan.scale_rows:
            inputs = make_estimator_inputs(fm.dev.estimator, batch=r, frames=t, seed=r + t,
                                           lengths=[t] * r)
            gf = flops(fm.dev.estimator.config, r, t)
            row = [t, r, f"{gf / 1e9:.4g}" if gf else "n/a"]
            if cuda:
                torch.cuda.reset_peak_memory_stats(fm.device)
            for mode in modes:
                est = fm.estimator(mode)
                try:
                    ms = clock.ms(lambda e=est: e(EstimatorInputs(**inputs)))
                except torch.cuda.OutOfMemoryError if cuda else MemoryError:
                    row.append("oom")
                    continue
                data["estimator_ms"][f"R{r}/T{t}/{mode}"] = ms
                print(f"scaling: T {t} rows {r} {mode} {ms:.2f} ms", file=sys.stderr, flush=True)
                row.append(f"{ms:.2f}" + (f" ({gf / ms / 1e9:.3g})" if gf else ""))
            set_tf32(False)
            if cuda:
                data["peak_mib"][f"R{r}/T{t}"] = torch.cuda.max_memory_allocated(fm.device) / 2**20
                ms = _graph_ms(fm, inputs, clock)
                if ms is not None:
                    data["graph_bf16_ms"][f"R{r}/T{t}"] = ms
                print(f"scaling: T {t} rows {r} bf16 CUDA graph {ms:.2f} ms", file=sys.stderr, flush=True)
                row.append("-" if ms is None else f"{ms:.2f}" + (f" ({gf / ms / 1e9:.3g})" if gf else ""))
            rows.append(row)
    enc_rows = []
    for b in plan.scale_encoder_batches:
        tokens = torch.randint(0, 6561, (b, plan.scale_encoder_tokens), device=fm.device)
        lens = torch.full((b,), plan.scale_encoder_tokens, device=fm.device)
        spk = torch.randn(b, 192, device=fm.device)

        def encode():
            with torch.inference_mode():
                return fm.dev.encoder(tokens, lens, spk)
        ms = clock.ms(encode)
        data["encoder_ms"][f"B{b}/N{plan.scale_encoder_tokens}"] = ms
        enc_rows.append([b, plan.scale_encoder_tokens, f"{ms:.2f}"])
    rep.data["scaling"] = data
    head = ["T", "rows", "GFLOP"] + modes + (["bf16 CUDA graph"] if cuda else [])
    rep.add("Scaling: estimator per call against rows and frames, encoder against batch",
            "ms per call (median), in brackets TFLOP/s (analytic count, matrix products only); every row's mask "
            "full. Eager torch in each mode, and the bf16 call replayed as one CUDA graph (the launch floor a "
            "TensorRT engine approaches). The encoder in fp32 (as served), eager.\n\n" + table(head, rows)
            + "\n\n" + table(["batch", "tokens", "encoder ms"], enc_rows))


def _graph_ms(fm: FlowModes, inputs: dict, clock: Clock):
    """The bf16 estimator call captured as a CUDA graph and replayed: ms per replay, None when capture fails."""
    import torch
    from s3flow.model.solver import EstimatorInputs
    est = fm.estimator("bf16")
    try:
        static = {k: v.clone() for k, v in inputs.items()}
        stream = torch.cuda.Stream(fm.device)
        stream.wait_stream(torch.cuda.current_stream(fm.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                est(EstimatorInputs(**static))
        torch.cuda.current_stream(fm.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            est(EstimatorInputs(**static))
        return clock.ms(graph.replay)
    except Exception:  # noqa: BLE001 - information only
        import traceback
        traceback.print_exc()
        return None
