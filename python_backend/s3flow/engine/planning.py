"""An utterance planned before it runs: its estimator calls and each chunk's work, from the real engine.

:func:`planned_calls` streams one utterance through a ``StreamingEngine`` over stand-in networks (zeros) and
records the (batch rows, frames) of every estimator call: the cost of any model size without running it (the
benchmarks' and measurements' FLOP counts). :func:`plan_work` groups those calls into each chunk's ``Work``
(``s3flow.engine.capacity``): what the capacity model prices a START at before it sent anything
(``s3flow.serving.calibration``).

Example::

    calls = planned_calls(80, prompt_tokens=50, chunks=[10, 20, 40], context_frames=100, steps=10)
    work = plan_work(80, meanflow=False, steps=10, guided=True, chunks=[10, 20, 40], prompt_tokens=50,
                     context_frames=100)
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from s3flow.engine.capacity import Work
from s3flow.engine.settings import ChunkSolving
from s3flow.engine.streaming import StreamingEngine
from s3flow.model.prefix_cache import PrefixCache
from s3flow.protocol import RequestRules, parse_request


def planned_calls(n_feats: int, prompt_tokens: int, chunks: Sequence[int], context_frames: int, steps: int,
                  meanflow: bool = False, prompt_frames: int = -1, slide_prompt: int = 0,
                  keep_solved: int = 0, by_voice: bool = False) -> list[tuple[int, int]]:
    """The (batch rows, frames) of every estimator call of one utterance streamed in ``chunks`` (guided unless
    ``meanflow``), planned by the real ``StreamingEngine`` over stand-in models (zeros): the cost of any model
    size without running it. ``prompt_frames``, ``slide_prompt`` and ``keep_solved`` are the ``ChunkSolving``
    fields (``s3flow.engine.reuse``: the frames a call reads from a cache are not among its frames); ``by_voice``:
    started by a registered voice whose prompt's cache is held (``s3flow.engine.voice_prompts``; its prompt pass
    made before, not counted)."""
    return _planned(n_feats, prompt_tokens, chunks, context_frames, steps, meanflow, prompt_frames, slide_prompt,
                    keep_solved, by_voice)[0]


class ZeroEstimator:
    """The estimator as zeros, recording each call's (rows, frames) in ``calls`` and the frames of the prefix cache
    its rows read in ``pasts``; it takes a prefix cache (and keeps empty ones): what plans and warm-ups run the
    engine over."""
    carries_prefix = True

    def __init__(self, calls: list[tuple[int, int]] | None = None):
        self.calls = [] if calls is None else calls
        self.pasts: list[int] = []

    def __call__(self, inputs):
        self.calls.append((inputs.x.shape[0], inputs.x.shape[2]))
        self.pasts.append(0 if inputs.past is None else int(inputs.past.mask.shape[-1]))
        v = torch.zeros_like(inputs.x)
        if inputs.keep is None:
            return v
        b, k = inputs.x.shape[0], max(1, int(inputs.keep.max()))
        empty = torch.zeros(0, b, 1, k, 1)
        return v, PrefixCache(empty, empty, torch.zeros(0, b, 1, 2),
                              (torch.arange(k)[None, :] < inputs.keep[:, None]).float()[:, None, :])


def _planned(n_feats: int, prompt_tokens: int, chunks: Sequence[int], context_frames: int, steps: int,
             meanflow: bool, prompt_frames: int, slide_prompt: int,
             keep_solved: int = 0, by_voice: bool = False
             ) -> tuple[list[tuple[int, int]], list[int], list[int], list[int]]:
    """:func:`planned_calls`, the mel frames each chunk's answer made final (the last chunk: as if the stream
    went on, so the frames its lookahead held back are not counted twice), each chunk's encoder tokens and each
    call's cached frames read (``ZeroEstimator.pasts``)."""
    calls: list[tuple[int, int]] = []
    final: list[int] = []
    encoded: list[int] = []

    def encode(tokens, token_len, embedding):
        encoded.append(int(tokens.shape[1]))
        t = 2 * tokens.shape[1]
        return torch.zeros(tokens.shape[0], n_feats, t), None, torch.zeros(tokens.shape[0], n_feats)

    rules = RequestRules(max_chunk_tokens=max(chunks))
    solving = ChunkSolving(context_frames=context_frames, prompt_frames=prompt_frames, slide_prompt=slide_prompt,
                           keep_solved=keep_solved, voice_cache_mb=1 if by_voice else 0,
                           max_utterance_frames=max(3000, 2 * sum(chunks)))
    estimator = ZeroEstimator(calls)
    engine = StreamingEngine(encode, estimator, n_feats=n_feats, meanflow=meanflow, solving=solving)
    rng = np.random.default_rng(0)
    prompt = dict(prompt_tokens=rng.integers(0, 6561, (1, prompt_tokens), dtype=np.int64),
                  prompt_mel=np.zeros((1, 2 * prompt_tokens, n_feats), np.float32),
                  speaker_embedding=np.ones((1, 192), np.float32), n_timesteps=np.array([[steps]], np.int32),
                  guidance_rate=np.array([[0.7]], np.float32))
    if by_voice:   # another stream of the voice made its prompt pass before
        req = parse_request({"speech_tokens": np.zeros((1, 1), np.int64), **prompt}, start=True, end=True,
                            rules=rules, n_feats=n_feats)
        req.voice = "v"
        engine.run([engine.admit(0, req)])
        calls.clear()
        encoded.clear()
        estimator.pasts.clear()
    for k, size in enumerate(chunks):
        inputs = {"speech_tokens": rng.integers(0, 6561, (1, size), dtype=np.int64), **(prompt if k == 0 else {})}
        req = parse_request(inputs, start=k == 0, end=k == len(chunks) - 1, rules=rules, n_feats=n_feats)
        req.voice = "v" if by_voice and k == 0 else None
        [answer] = engine.run([engine.admit(1, req)])
        final.append(int(answer.mel.shape[1]))
    if len(final) > 1:   # an END makes the held-back frames final too: a stream that goes on does not
        final[-1] = 2 * chunks[-1]
    return calls, final, encoded, estimator.pasts


def plan_work(n_feats: int, meanflow: bool, steps: int, guided: bool, chunks: list[int], prompt_tokens: int,
              context_frames: int, prompt_frames: int = -1, slide_prompt: int = 0,
              keep_solved: int = 0) -> list[Work]:
    """The work of each chunk of one utterance streamed in ``chunks`` (token counts), planned by the real engine
    over stand-in networks (:func:`planned_calls`): what a START is priced at before it sent anything. Each chunk's
    frames are those its answer makes final, as a served stream's are (the first: its tokens' frames less the
    lookahead held back), so a stream like the plan is priced like the plan at every answer."""
    calls, final, encoded, pasts = _planned(n_feats, prompt_tokens, chunks, context_frames, steps,
                                            meanflow or not guided, prompt_frames, slide_prompt, keep_solved)
    out = []
    for k, tokens in enumerate(chunks):   # every chunk is ``steps`` estimator calls, one encoder call
        mine, read = calls[k * steps:(k + 1) * steps], pasts[k * steps:(k + 1) * steps]
        out.append(Work(row_frames=float(sum(r * f for r, f in mine)), steps=len(mine), chunks=1,
                        encoder_tokens=encoded[k], frames=final[k],
                        key_row_frames=float(sum(r * p for (r, _), p in zip(mine, read)))))
    return out
