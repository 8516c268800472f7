"""Warm start: what each served model runs before its first real request (no Triton imports here).

The first call of a fresh model instance pays for ONNX Runtime's (or TensorRT's) first-run set-up, the
allocator's growth and torch's lazy kernel set-up. Two mechanisms, by the kind of model:

* **stateless** ``flow_encoder`` and ``estimator`` (ONNX Runtime python models on CPU hosts, TensorRT
  plans on GPU hosts): Triton's own ``model_warmup`` samples in ``config.pbtxt``
  (:func:`write_model_warmup`), run by Triton on every instance before it is marked ready, whatever the
  backend. Token ids and lengths come from ``warmup/`` data files, so the encoder sees a valid request.
* **sequence-batched** ``cfm_solver`` and ``vocoder``: a Triton warm-up request would reach them without a
  sequence slot, and the solver's would call the encoder and estimator over BLS while they may still be
  loading. They warm up inside ``initialize`` instead, through their own code path:

  - the solver (:func:`warm_up_solver`) runs one short utterance (a START chunk, then the END chunk)
    through a throw-away ``SolverSession`` over a ``StreamingEngine`` with the served engine's settings
    and stand-in encoder/estimator callables: validation, admission, the Euler loop's torch work and
    the commit all run; nothing touches the served engine's sequence store;
  - the vocoder (:func:`warm_up_vocoder`) streams a short mel through a fresh ``VocoderState`` of its
    ``VocoderStream`` (both ONNX Runtime sessions run) and throws the state away.

Example::

    from s3flow.serving.warmup import warm_up_solver
    report = warm_up_solver(engine)              # engine: the served StreamingEngine
    print(report.describe())                     # "warm-up: 2 chunks, 13 estimator calls in 0.21 s"
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Speech tokens of a warm-up request (4 s: the size of a typical chunk's solve with its prompt).
WARMUP_TOKENS = 100
#: Prompt tokens of the solver's warm-up utterance.
WARMUP_PROMPT_TOKENS = 25
#: Triton runs each ``model_warmup`` sample this many times (the second run of ONNX Runtime is the steady one).
WARMUP_ITERATIONS = 2
#: Mel frames the vocoder's warm-up streams, in two chunks.
VOCODER_WARMUP_FRAMES = (40, 40)


@dataclass
class WarmupReport:
    """What one warm-up ran: ``chunks`` requests through the model's path, ``calls`` network calls."""
    model: str
    chunks: int
    calls: int
    seconds: float

    def describe(self) -> str:
        return (f"{self.model}: warm-up: {self.chunks} chunks, {self.calls} network calls in "
                f"{self.seconds:.2f} s")


# -------------------------------------------------------------------------------- stateless: model_warmup
def _raw(path: Path, array: np.ndarray) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.ascontiguousarray(array).tobytes())
    return path.name


def _sample(name: str, inputs: dict, iterations: int) -> str:
    """One ``model_warmup`` entry; ``inputs``: {tensor: (TYPE_*, dims, 'zero'|'random'|file name)}."""
    items = []
    for tensor, (dtype, dims, data) in inputs.items():
        source = {"zero": "zero_data: true", "random": "random_data: true"}.get(data, f'input_data_file: "{data}"')
        items.append(f'      {{ key: "{tensor}" value: {{ data_type: {dtype} dims: {list(dims)} {source} }} }}')
    return (f'  {{\n    name: "{name}"\n    batch_size: 1\n    count: {iterations}\n    inputs [\n'
            + ",\n".join(items) + "\n    ]\n  }")


def encoder_warmup(model_dir: Path, tokens: int = WARMUP_TOKENS, iterations: int = WARMUP_ITERATIONS) -> str:
    """The ``model_warmup`` block of ``flow_encoder`` (one utterance of ``tokens`` token ids 0); writes
    ``warmup/token_len`` (int64, the true length: a zero length would be a request no client sends)."""
    token_len = _raw(model_dir / "warmup" / "token_len", np.array([tokens], np.int64))
    sample = _sample(f"tokens_{tokens}", {"tokens": ("TYPE_INT64", [1, tokens], "zero"),
                                          "token_len": ("TYPE_INT64", [1], token_len),
                                          "embedding": ("TYPE_FP32", [1, 192], "random")}, iterations)
    return f"model_warmup [\n{sample}\n]\n"


def estimator_warmup(model_dir: Path, n_feats: int, meanflow: bool, frames: int = 2 * WARMUP_TOKENS,
                     iterations: int = WARMUP_ITERATIONS) -> str:
    """The ``model_warmup`` block of ``estimator``: one Euler step's call for one sequence, ``frames``
    long (2 rows, as classifier-free guidance calls it; 1 for meanflow); the mask (``warmup/mask``) is
    all ones, so every frame is computed."""
    rows = 1 if meanflow else 2
    mask = _raw(model_dir / "warmup" / "mask", np.ones((rows, 1, frames), np.float32))
    inputs = {"x": ("TYPE_FP32", [rows, n_feats, frames], "random"),
              "mask": ("TYPE_FP32", [rows, 1, frames], mask),
              "mu": ("TYPE_FP32", [rows, n_feats, frames], "random"),
              "t": ("TYPE_FP32", [rows], "random"),
              "spks": ("TYPE_FP32", [rows, n_feats], "random"),
              "cond": ("TYPE_FP32", [rows, n_feats, frames], "random")}
    if meanflow:
        inputs["r"] = ("TYPE_FP32", [rows], "random")
    return f"model_warmup [\n{_sample(f'rows_{rows}_frames_{frames}', inputs, iterations)}\n]\n"


def model_warmup_of(config: str) -> str:
    """The ``model_warmup`` block a config written by :func:`write_model_warmup` ends with ("" if none), to
    keep it when the rest of the config is written again (``scripts/build_engines.py`` switching backends)."""
    at = config.find("model_warmup [")
    return config[at:] if at >= 0 else ""


def write_model_warmup(repository: Path, n_feats: int, meanflow: bool) -> list[Path]:
    """Append ``model_warmup`` to ``flow_encoder`` and ``estimator``'s ``config.pbtxt`` in ``repository``
    and write their ``warmup/`` data files; return the files written."""
    files = []
    for name, block in (("flow_encoder", encoder_warmup(repository / "flow_encoder")),
                        ("estimator", estimator_warmup(repository / "estimator", n_feats, meanflow))):
        config = repository / name / "config.pbtxt"
        text = config.read_text()
        if "model_warmup" in text:
            raise ValueError(f"{config} has a model_warmup already")
        config.write_text(text + block)
        files += [config, *sorted((repository / name / "warmup").iterdir())]
    return files


# -------------------------------------------------------------------------------- stateful: in initialize
def warm_up_solver(engine, prompt_tokens: int = WARMUP_PROMPT_TOKENS,
                   chunks: tuple = (WARMUP_TOKENS - 10, 10)) -> WarmupReport:
    """Run one short utterance through the served solver's code path with stand-in networks.

    ``engine``: the served ``StreamingEngine`` (its settings are copied; its store is not touched). The
    requests are the tensors a client sends (validated by ``s3flow.protocol``); the stand-in encoder gives
    2 frames per token, the stand-in estimator a zero velocity.
    """
    import torch

    from s3flow.serving.session import Incoming, SolverSession
    from s3flow.engine.streaming import StreamingEngine

    calls = [0]

    def encode(tokens, token_len, embedding):
        calls[0] += 1
        b, t = tokens.shape[0], 2 * tokens.shape[1]
        return (torch.zeros(b, engine.n_feats, t), torch.ones(b, 1, t), torch.zeros(b, engine.n_feats))

    def estimate(x, mask, mu, t, spks, cond, r=None):
        calls[0] += 1
        return torch.zeros_like(x)

    shadow = StreamingEngine(encode, estimate, n_feats=engine.n_feats, meanflow=engine.meanflow,
                             limits=engine.limits, bucket_ratio=getattr(engine, "bucket_ratio", 0.0))
    session = SolverSession(shadow, name="warm-up")
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for k, size in enumerate(chunks):
        inputs = {"speech_tokens": rng.integers(0, 6561, (1, size), dtype=np.int64)}
        if k == 0:
            inputs.update(prompt_tokens=rng.integers(0, 6561, (1, prompt_tokens), dtype=np.int64),
                          prompt_mel=np.zeros((1, 2 * prompt_tokens, engine.n_feats), np.float32),
                          speaker_embedding=np.ones((1, 192), np.float32))
        [outcome] = session.handle([Incoming(corr_id=0, start=k == 0, end=k == len(chunks) - 1, inputs=inputs)])
        if outcome.error is not None:
            raise RuntimeError(f"the solver's warm-up request was refused: {outcome.error}")
    if len(shadow.store):
        raise RuntimeError("the solver's warm-up left a sequence behind")
    return WarmupReport("cfm_solver", len(chunks), calls[0], time.perf_counter() - t0)


def warm_up_vocoder(stream, frames: tuple = VOCODER_WARMUP_FRAMES) -> WarmupReport:
    """Stream ``sum(frames)`` frames of a quiet mel through ``stream`` (a ``VocoderStream``) on a fresh
    state that is thrown away: both ONNX Runtime sessions run on realistic shapes."""
    state = stream.start(seed=0)
    t0, offset = time.perf_counter(), 0
    for k, n in enumerate(frames):
        mel = np.full((stream.n_feats, n), -6.0, np.float32)
        stream.push(state, mel, offset, end=k == len(frames) - 1)
        offset += n
    return WarmupReport("vocoder", len(frames), 2 * len(frames), time.perf_counter() - t0)
