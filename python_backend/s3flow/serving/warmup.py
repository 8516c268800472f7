"""Warm start: what each served model runs before its first real request (no server imports here).

The first call of a fresh model instance pays for ONNX Runtime's (or TensorRT's) first-run set-up, the
allocator's growth and torch's lazy kernel set-up. Two mechanisms, by the kind of model:

* **stateless** ``flow_encoder`` and ``estimator`` (ONNX Runtime python models on CPU hosts, TensorRT
  plans on GPU hosts): Triton's own ``model_warmup`` samples in ``config.pbtxt`` (``ModelWarmup``
  messages over the contract's tensors: :func:`add_model_warmup`, :func:`write_model_warmup`), run by
  Triton on every instance before it is marked ready, whatever the backend. Token ids are 0 and the
  lengths come from ``warmup/`` data files, so the encoder sees a valid request.
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
from tritonclient.grpc import model_config_pb2 as mc

from s3flow.contract import ENCODER_INPUTS, VOCAB_SIZE, XVECTOR_DIM, by_name, estimator_inputs, request_arrays
from s3flow.serving.model_config import read_config, write_config

#: Speech tokens of a warm-up request (4 s: the size of a typical chunk's solve with its prompt).
WARMUP_TOKENS = 100
#: Prompt tokens of the solver's warm-up utterance.
WARMUP_PROMPT_TOKENS = 25
#: Triton runs each ``model_warmup`` sample this many times (the second run of ONNX Runtime is the steady one).
WARMUP_ITERATIONS = 2
#: Mel frames the vocoder's warm-up streams, in two chunks.
VOCODER_WARMUP_FRAMES = (40, 40)
#: The folder of a model's warm-up data files (``input_data_file`` is read from there).
WARMUP_DIR = "warmup"
#: The tensors a warm-up gives real values: token ids 0 (valid), their true length, a mask of ones.
_TOKENS, _TOKEN_LEN = (by_name(ENCODER_INPUTS)[n].name for n in ("tokens", "token_len"))
_MASK = by_name(estimator_inputs(False))["mask"].name


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
def _sample(name: str, tensors: tuple, n_feats: int, batch: int, length: int, iterations: int,
            data: dict) -> tuple[mc.ModelWarmup, dict[str, bytes]]:
    """One ``model_warmup`` sample over the contract's ``tensors``: dims with the first ``-1`` as ``batch``,
    the others as ``length``; ``data``: {tensor: "zero" | a numpy array}, random data for the rest. Returns
    the sample and its data files ({path in the model folder: bytes})."""
    sample = mc.ModelWarmup(name=name, batch_size=1, count=iterations)
    files = {}
    for t in tensors:
        dims = [batch if i == 0 and d == -1 else (length if d == -1 else d) for i, d in enumerate(t.shape(n_feats))]
        spec = sample.inputs[t.name]
        spec.data_type = mc.DataType.Value(t.config_type)
        spec.dims.extend(dims)
        given = data.get(t.name)
        if given is None:
            spec.random_data = True
        elif isinstance(given, str) and given == "zero":
            spec.zero_data = True
        else:
            array = np.ascontiguousarray(np.broadcast_to(np.asarray(given, dtype=t.np_dtype), dims))
            spec.input_data_file = t.name
            files[f"{WARMUP_DIR}/{t.name}"] = array.tobytes()
    return sample, files


def encoder_warmup(tokens: int = WARMUP_TOKENS, iterations: int = WARMUP_ITERATIONS
                   ) -> tuple[mc.ModelWarmup, dict[str, bytes]]:
    """The ``model_warmup`` sample of ``flow_encoder``: one utterance of ``tokens`` token ids 0, its true
    length in the data file ``warmup/token_len`` (a zero length would be a request no client sends)."""
    return _sample(f"tokens_{tokens}", ENCODER_INPUTS, 0, 1, tokens, iterations,
                   {_TOKENS: "zero", _TOKEN_LEN: np.array([tokens])})


def estimator_warmup(n_feats: int, meanflow: bool, frames: int = 2 * WARMUP_TOKENS,
                     iterations: int = WARMUP_ITERATIONS) -> tuple[mc.ModelWarmup, dict[str, bytes]]:
    """The ``model_warmup`` sample of ``estimator``: one Euler step's call for one sequence, ``frames`` long
    (2 rows, as classifier-free guidance calls it; 1 for meanflow); the mask (``warmup/mask``) is all ones,
    so every frame is computed."""
    rows = 1 if meanflow else 2
    return _sample(f"rows_{rows}_frames_{frames}", estimator_inputs(meanflow), n_feats, rows, frames, iterations,
                   {_MASK: np.ones(1)})


def add_model_warmup(config: mc.ModelConfig, n_feats: int, meanflow: bool) -> dict[str, bytes]:
    """Add the warm-up sample of ``config``'s model (``flow_encoder`` or ``estimator``) to it; return the
    data files the sample reads ({path in the model folder: bytes})."""
    if config.model_warmup:
        raise ValueError(f"{config.name}'s config has a model_warmup already")
    if config.name == "flow_encoder":
        sample, files = encoder_warmup()
    elif config.name == "estimator":
        sample, files = estimator_warmup(n_feats, meanflow)
    else:
        raise ValueError(f"no model_warmup sample for {config.name!r} (flow_encoder and estimator have one)")
    config.model_warmup.append(sample)
    return files


def write_model_warmup(repository: Path, n_feats: int, meanflow: bool) -> list[Path]:
    """Add ``model_warmup`` to the configs of ``flow_encoder`` and ``estimator`` in ``repository`` and write
    their ``warmup/`` data files; return the files written."""
    written = []
    for name in ("flow_encoder", "estimator"):
        folder = Path(repository) / name
        config = read_config(folder)
        files = add_model_warmup(config, n_feats, meanflow)
        written.append(write_config(folder, config))
        for rel, data in sorted(files.items()):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
            written.append(folder / rel)
    return written


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
        speech = rng.integers(0, VOCAB_SIZE, size)
        prompt = {} if k else dict(prompt_tokens=rng.integers(0, VOCAB_SIZE, prompt_tokens),
                                   prompt_mel=np.zeros((2 * prompt_tokens, engine.n_feats)),
                                   speaker_embedding=np.ones(XVECTOR_DIM))
        inputs = request_arrays(speech, start=k == 0, **prompt)
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
