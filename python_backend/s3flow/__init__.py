"""s3flow: Chatterbox S3Gen's flow-matching token-to-mel decoder, packaged for serving on Triton.

Layers, lowest first; a module imports only from its own layer or lower ones (tests/test_layers.py):

- ``s3flow.contract``, ``s3flow.protocol``: every tensor's name, dtype and dims; request validation (numpy only)
- ``s3flow.model``: the torch ports (estimator, encoder, flow, solver, chunks, vocoder, voice front-end,
  checkpoint layout)
- ``s3flow.runtime``: running the estimator and friends on a backend (ONNX export, ONNX Runtime, TensorRT)
- ``s3flow.engine``: Triton-free streaming state (the chunk engine, the vocoder stream)
- ``s3flow.serving``: everything Triton (repository generator, the python models, sessions, launcher, drain,
  metrics, warm-up, voices)

Training (``s3flow_training``, top-level ``training/``) sits outside the served package.
"""
__all__ = ["ClassifierFreeGuidance", "ConditionalField", "CountingEstimator", "FrameNoise", "SolveResult",
           "euler_solve", "solve_cfm", "time_grid"]


def __getattr__(name):  # lazy: torch is heavy, and the drain probe (s3flow.serving.drain) must start in a blink
    if name in __all__:
        from s3flow.model import solver
        return getattr(solver, name)
    if name in ("FlowConfig", "S3Flow", "synthesize", "SynthesisResult"):
        from s3flow.model import flow
        return getattr(flow, name)
    if name in ("load_flow", "write_random_checkpoint", "random_flow"):
        from s3flow.model import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(name)
