"""s3flow: Chatterbox S3Gen's flow-matching token-to-mel decoder, packaged for serving on Triton.

Modules: ``estimator`` (ConditionalDecoder U-Net), ``encoder`` (token encoder), ``solver`` (Euler CFM
solver, guidance, time grid, noise), ``chunks`` (how every solve's condition and starting point are
built), ``flow`` (in-process synthesis), ``checkpoint`` (upstream layout), ``onnx_export``, ``streaming``
(per-sequence state, the chunk engine), ``session`` (the solver model's request handling),
``triton_server`` (launching tritonserver).
"""
__all__ = ["ClassifierFreeGuidance", "ConditionalField", "CountingEstimator", "FrameNoise", "SolveResult",
           "euler_solve", "solve_cfm", "time_grid"]


def __getattr__(name):  # lazy: torch is heavy, and the drain probe (s3flow.drain) must start in a blink
    if name in __all__:
        from . import solver
        return getattr(solver, name)
    if name in ("FlowConfig", "S3Flow", "synthesize", "SynthesisResult"):
        from . import flow
        return getattr(flow, name)
    if name in ("load_flow", "write_random_checkpoint", "random_flow"):
        from . import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(name)
