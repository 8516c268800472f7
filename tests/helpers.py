"""Shared test utilities: a small seeded flow and an in-process streaming driver."""
from __future__ import annotations

import functools

import torch

from s3flow.model.random_checkpoint import random_flow
from s3flow.model.flow import FlowConfig, TorchEstimator, synthesize
from s3flow.engine.observer import NO_OBSERVER, Observer
from s3flow.engine.sequences import SequenceTable
from s3flow.engine.settings import SolverSettings
from s3flow.protocol import RequestRules, parse_request
from s3flow.engine.streaming import StreamingEngine
from s3flow_client import Utterance


@functools.lru_cache(maxsize=4)
def small_flow(meanflow: bool = False, seed: int = 0):
    return random_flow(FlowConfig.small(meanflow), seed=seed)


def torch_encoder(flow):
    def encode(tokens, token_len, embedding):
        with torch.inference_mode():
            return flow.encoder(tokens, token_len, embedding)
    return encode


class DropLog(Observer):
    """An engine observer that records every dropped sequence as (corr_id, reason), in order."""

    def __init__(self, drops: list | None = None):
        self.drops: list[tuple[object, str]] = [] if drops is None else drops

    def sequence_dropped(self, corr_id, reason: str) -> None:
        self.drops.append((corr_id, reason))


def make_engine(flow, settings: SolverSettings | None = None, observer: Observer = NO_OBSERVER,
                clock=None, playback=None) -> StreamingEngine:
    """The served engine over the flow's torch modules, with ``settings``' chunk solving and capacity (the
    request rules are the driver's: ``stream_in_process(..., rules=settings.rules)``); ``clock`` and ``playback``
    (``PlaybackSettings``) for its sequence table where given."""
    settings = settings or SolverSettings()
    table = None
    if clock is not None or playback is not None:
        table = SequenceTable(settings.sequences, observer, **({"clock": clock} if clock is not None else {}),
                              **({"playback": playback} if playback is not None else {}))
    return StreamingEngine(torch_encoder(flow), TorchEstimator(flow.estimator), n_feats=flow.config.n_feats,
                           meanflow=flow.config.meanflow, solving=settings.solving, limits=settings.sequences,
                           observer=observer, table=table)


def request_inputs(u: Utterance, lo: int, hi: int, first: bool) -> dict:
    """The tensors of the chunk speech_tokens[lo:hi] as the client sends them (``Utterance.request``)."""
    return u.request(lo, hi, first)


def stream_in_process(engine: StreamingEngine, utts: list[Utterance], sizes: list[list[int]],
                      rules: RequestRules | None = None):
    """Drive several utterances chunk by chunk; chunks of the same round go in one engine.run batch, each
    request validated by ``rules`` (default: the defaults). Returns per utterance the list of ChunkResults."""
    rules = rules or RequestRules()
    out = [[] for _ in utts]
    rounds = max(len(s) for s in sizes)
    for k in range(rounds):
        items, who = [], []
        for i, (u, s) in enumerate(zip(utts, sizes)):
            if k >= len(s):
                continue
            lo = sum(s[:k])
            end = k == len(s) - 1
            req = parse_request(request_inputs(u, lo, lo + s[k], k == 0), start=k == 0, end=end,
                                rules=rules, n_feats=engine.n_feats)
            items.append(engine.admit(100 + i, req))
            who.append(i)
        for i, res in zip(who, engine.run(items)):
            out[i].append(res)
    return out


def offline(flow, u: Utterance, n_tokens: int | None = None, finalize: bool = True, **kw):
    """Offline synthesis of the first n_tokens speech tokens of u, same noise seed."""
    n = len(u.speech_tokens) if n_tokens is None else n_tokens
    return synthesize(flow, torch.from_numpy(u.speech_tokens[:n])[None], torch.from_numpy(u.prompt_tokens)[None],
                      torch.from_numpy(u.prompt_mel)[None], torch.from_numpy(u.speaker_embedding)[None],
                      finalize=finalize, seed=u.seed, **kw).mel[0].numpy()
