"""s3flow: Chatterbox S3Gen's flow-matching token-to-mel decoder, packaged for serving on Triton.

Layers, lowest first; a module imports only from its own layer or lower ones (tests/test_layers.py):

- ``s3flow_contract.tensors``, ``s3flow.protocol``: every tensor's name, dtype and dims; request validation (numpy only)
- ``s3flow.model``: the torch ports (estimator, encoder, flow, solver, chunks, vocoder, voice front-end,
  checkpoint layout)
- ``s3flow.runtime``: running the estimator and friends on a backend (ONNX export, ONNX Runtime, TensorRT)
- ``s3flow.engine``: Triton-free streaming state (the chunk engine, the vocoder stream)
- ``s3flow.serving``: everything Triton (repository generator, the python models, sessions, launcher, drain,
  metrics, warm-up, voices)

Training (``s3flow_training``, top-level ``training/``) sits outside the served package.
"""
