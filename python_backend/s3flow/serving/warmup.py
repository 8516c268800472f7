"""Warm start: what each served model runs before its first real request (no server imports here).

The first call of a fresh model instance pays for ONNX Runtime's (or TensorRT's) first-run set-up, the
allocator's growth and torch's lazy kernel set-up. Two mechanisms, by the kind of model:

* **stateless** ``flow_encoder`` and ``estimator`` (ONNX Runtime python models on CPU hosts, TensorRT
  plans on GPU hosts): Triton's own ``model_warmup`` samples in ``config.pbtxt`` (``ModelWarmup``
  messages over the contract's tensors: ``s3flow.repository.warmup_samples``), run by
  Triton on every instance before it is marked ready, whatever the backend. Token ids are 0 and the
  lengths come from ``warmup/`` data files, so the encoder sees a valid request.
* **sequence-batched** ``cfm_solver`` and ``vocoder``: a Triton warm-up request would reach them without a
  sequence slot, and the solver's would call the encoder and estimator over BLS while they may still be
  loading. They warm up inside ``initialize`` instead, through their own code path (the solver's one
  ``model_warmup`` request carries no sequence controls and is answered empty: it only tells the solver that
  its instance is set up, ``s3flow.serving.calibration``):

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
from typing import Optional

import numpy as np

from s3flow_contract.tensors import FRAMES_PER_SECOND, VOCAB_SIZE, XVECTOR_DIM, request_arrays

#: Speech tokens of a warm-up request (4 s: the size of a typical chunk's solve with its prompt).
WARMUP_TOKENS = 100
#: Prompt tokens of the solver's warm-up utterance.
WARMUP_PROMPT_TOKENS = 25
#: Mel frames the vocoder's warm-up streams, in two chunks.
VOCODER_WARMUP_FRAMES = (40, 40)
#: Seconds of audio the vocoder's calibration at load makes, in the client's default chunks.
VOCODER_CALIBRATION_S = 4.0


@dataclass
class WarmupReport:
    """What one warm-up (or calibration, ``what``) ran: ``chunks`` requests through the model's path, ``calls``
    network calls."""
    model: str
    chunks: int
    calls: int
    seconds: float
    what: str = "warm-up"

    def describe(self) -> str:
        return (f"{self.model}: {self.what}: {self.chunks} chunks, {self.calls} network calls in "
                f"{self.seconds:.2f} s")


# -------------------------------------------------------------------------------- stateful: in initialize
def warm_up_solver(engine, rules=None, prompt_tokens: int = WARMUP_PROMPT_TOKENS,
                   chunks: tuple = (WARMUP_TOKENS - 10, 10)) -> WarmupReport:
    """Run one short utterance through the served solver's code path with stand-in networks.

    ``engine``: the served ``StreamingEngine`` (its settings are copied; its sequences are not touched);
    ``rules``: the served ``RequestRules`` (default: the defaults). The
    requests are the tensors a client sends (validated by ``s3flow.protocol``); the stand-in encoder gives
    2 frames per token, the stand-in estimator a zero velocity.
    """
    import torch

    from s3flow.engine.streaming import StreamingEngine
    from s3flow.protocol import RequestRules
    from s3flow.serving.session import SolverSession

    rules = rules or RequestRules()

    from s3flow.engine.planning import ZeroEstimator

    encoded, estimate = [0], ZeroEstimator()

    def encode(tokens, token_len, embedding):
        encoded[0] += 1
        b, t = tokens.shape[0], 2 * tokens.shape[1]
        return (torch.zeros(b, engine.n_feats, t), torch.ones(b, 1, t), torch.zeros(b, engine.n_feats))

    shadow = StreamingEngine(encode, estimate, n_feats=engine.n_feats, meanflow=engine.meanflow,
                             solving=engine.solving, limits=engine.sequences.limits,
                             bucket_ratio=engine.bucket_ratio)
    t0 = time.perf_counter()
    _utterances(SolverSession(shadow, rules, name="warm-up"), engine.n_feats, prompt_tokens, chunks, streams=1)
    return WarmupReport("cfm_solver", len(chunks), encoded[0] + len(estimate.calls), time.perf_counter() - t0)


def calibrate_solver(engine, observer, rules=None, streams: tuple = (1, 4), steps: int = 2, rounds: int = 3,
                     prompt_tokens: int = WARMUP_PROMPT_TOKENS, chunks: tuple = (WARMUP_TOKENS - 10, 10),
                     wait_idle=lambda: None) -> WarmupReport:
    """The warm-up's utterance at ``steps`` Euler steps through the served engine's real networks, ``streams`` of
    them at once (one batch each), ``rounds`` times; each call shape's fastest time is reported to ``observer``
    (``s3flow.engine.capacity.CapacityModel``: its cost fits start from these timed calls at a few batch sizes; the
    fastest, because at load the other models are still setting themselves up beside it, and a shape's first call
    sets up its buffers). The last round's largest batch also prices the time between the calls: its wall time
    (as the served solver's busy time is measured) over what the fits price its work at is the observer's
    correction until served work measures its own (``CapacityModel.calibrated``: the python around the calls, the
    hops, which the fastest calls alone leave out: x1.1-1.4 on the 2-core host, issue 48). ``wait_idle()`` is called
    before each batch (it returns when the served engine holds no stream: a real stream never shares the cores with
    the calibration). Throw-away engines: the served one's sequences are not touched."""
    from s3flow.engine.capacity import Work
    from s3flow.engine.observer import Observer
    from s3flow.engine.streaming import StreamingEngine
    from s3flow.protocol import RequestRules
    from s3flow.serving.session import SolverSession

    class Fastest(Observer):
        def __init__(self):
            self.estimator: dict = {}
            self.encoder: dict = {}
            self.made = Work()

        def estimator_timed(self, rows, frames, seconds, past=0):
            key = (rows, frames, past)
            self.estimator[key] = min(seconds, self.estimator.get(key, seconds))

        def encoder_timed(self, tokens, seconds):
            self.encoder[tokens] = min(seconds, self.encoder.get(tokens, seconds))

        def chunk_work(self, corr_id, work):
            self.made.add(work)

    fastest, t0, calls = Fastest(), time.perf_counter(), 0
    for _ in range(rounds):
        shadow = StreamingEngine(engine.encode, engine.estimator, n_feats=engine.n_feats, meanflow=engine.meanflow,
                                 solving=engine.solving, limits=engine.sequences.limits, observer=fastest)
        session = SolverSession(shadow, rules or RequestRules(), name="calibration")
        for n in streams:
            wait_idle()
            fastest.made, started = Work(), time.perf_counter()
            _utterances(session, engine.n_feats, prompt_tokens, chunks, n, steps)
            busy = time.perf_counter() - started   # (the last round's largest batch is kept)
        calls += shadow.estimator_calls
    for (rows, frames, past), seconds in fastest.estimator.items():
        observer.estimator_timed(rows, frames, seconds, past)
    for tokens, seconds in fastest.encoder.items():
        observer.encoder_timed(tokens, seconds)
    observer.calibrated(busy, fastest.made, streams[-1])
    return WarmupReport("cfm_solver", rounds * len(chunks) * sum(streams), calls, time.perf_counter() - t0,
                        "calibration")


def _utterances(session, n_feats: int, prompt_tokens: int, chunks: tuple, streams: int,
                steps: Optional[int] = None) -> None:
    """``streams`` copies of one short utterance (``chunks`` token counts; ``steps``: the START's n_timesteps,
    None: the default) through ``session``, chunk k of all of them in one call."""
    from s3flow.serving.incoming import Incoming

    rng = np.random.default_rng(0)
    for k, size in enumerate(chunks):
        speech = rng.integers(0, VOCAB_SIZE, size)
        prompt = {} if k else dict(prompt_tokens=rng.integers(0, VOCAB_SIZE, prompt_tokens),
                                   prompt_mel=np.zeros((2 * prompt_tokens, n_feats)),
                                   speaker_embedding=np.ones(XVECTOR_DIM))
        if not k and steps is not None:
            prompt["n_timesteps"] = steps
        inputs = request_arrays(speech, start=k == 0, **prompt)
        outcomes = session.handle([Incoming(corr_id=i, start=k == 0, end=k == len(chunks) - 1, inputs=inputs)
                                   for i in range(streams)])
        for outcome in outcomes:
            if outcome.error is not None:
                raise RuntimeError(f"the solver's warm-up request was refused: {outcome.error}")
    if len(session.engine.sequences):
        raise RuntimeError("the solver's warm-up left a sequence behind")


def calibrate_vocoder(stream, model, seconds: float = VOCODER_CALIBRATION_S, seal=None) -> WarmupReport:
    """Price the vocoder before its first stream: the client's default chunks of a ``seconds`` utterance (as mel
    frames, two a token) streamed through a fresh state of ``stream`` (a ``VocoderStream``, thrown away), each push
    (and ``seal(state)``, the snapshot a served push makes) timed into ``model``
    (``s3flow.engine.capacity.CapacityModel``: its cost fit, as a served push is), and the audio made over the
    whole time as its capacity until served pushes measure their own, unless a price saved from served work
    (``s3flow.serving.saved_price``) gave one. Without it a new server priced its first token2wav burst by the
    solver alone: 4 of 5 admitted streams stalled (issue 48, results/qos.md). Run it on a quiet host: the same
    pushes timed while the other models loaded took three times as long (10 against 28-40 audio s per s)."""
    from s3flow.engine.capacity import default_plan

    state = stream.start(seed=0)
    busy, offset = 0.0, 0
    sizes = [2 * tokens for tokens in default_plan(seconds)]
    for k, n in enumerate(sizes):
        mel = np.full((stream.n_feats, n), -6.0, np.float32)
        started = time.perf_counter()
        state, _ = stream.push(state, mel, offset, end=k == len(sizes) - 1)
        if seal is not None and k < len(sizes) - 1:
            seal(state)
        took = time.perf_counter() - started
        model.estimator_timed(1, n, took)
        busy += took
        offset += n
    if model.prior_capacity is None:
        model.prior_capacity = offset / FRAMES_PER_SECOND / busy
    return WarmupReport("vocoder", len(sizes), 2 * len(sizes), busy, "calibration")


def warm_up_vocoder(stream, frames: tuple = VOCODER_WARMUP_FRAMES) -> WarmupReport:
    """Stream ``sum(frames)`` frames of a quiet mel through ``stream`` (a ``VocoderStream``) on a fresh
    state that is thrown away: both ONNX Runtime sessions run on realistic shapes."""
    state = stream.start(seed=0)
    t0, offset = time.perf_counter(), 0
    for k, n in enumerate(frames):
        mel = np.full((stream.n_feats, n), -6.0, np.float32)
        state, _ = stream.push(state, mel, offset, end=k == len(frames) - 1)
        offset += n
    return WarmupReport("vocoder", len(frames), 2 * len(frames), time.perf_counter() - t0)
