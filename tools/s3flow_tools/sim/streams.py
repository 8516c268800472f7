"""Streaming clients on the virtual server's clock: what each stream's player hears (issue 51).

Each stream is the batch ``StreamingClient``'s: its utterance's chunks (the client's schedule, ``chunk_schedule``,
unless the utterance names its own), each sent when the previous one is answered, the START at the stream's
start time; a request is the client's own tensors (``Utterance.request``) validated by the server's own parser
(``s3flow.protocol.parse_request``). A request reaches the server half the host's ``transit_s`` after it is sent
and its answer the client half of it after it is made. The result is a ``StreamResult`` like the real client's
(chunk latencies and frames, so ``playback_stalls`` is the same player), with its first answer's time. An
utterance that names a ``voice_id`` starts by it (the engine's ``ChunkRequest.voice``: its voice's prompt cache).

Example::

    server = VirtualServer(settings, costs, HostCosts(transit_s=0.01), n_feats=80)
    results = run_streams(server, utterances, starts=[0.0, 0.5, 1.0], rules=settings.solver.rules)
    results[0].first_chunk_s, results[0].playback_stalls(0.3)
"""
from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import numpy as np

from s3flow_client import StreamResult, Utterance
from s3flow_client.chunking import chunk_schedule
from s3flow_contract.tensors import TOKEN_MEL_RATIO
from s3flow.protocol import RequestRules, parse_request
from s3flow_tools.sim.virtual_server import VirtualServer


class _Stream:
    def __init__(self, corr_id: int, utt: Utterance, start_at: float):
        self.corr_id, self.utt, self.start_at = corr_id, utt, start_at
        self.sizes = list(utt.chunks or chunk_schedule(len(utt.speech_tokens)))
        self.sent = 0                  # chunks sent
        self.sent_at = 0.0
        self.latencies: list[float] = []
        self.frames: list[int] = []
        self.mels: list[np.ndarray] = []
        self.error = None
        self.done_at = None

    def request(self, rules: RequestRules, n_feats: int):
        """The next chunk's request, and the names of the tensors the client sends with it."""
        k = self.sent
        lo = sum(self.sizes[:k])
        arrays = self.utt.request(lo, lo + self.sizes[k], start=k == 0)
        req = parse_request(arrays, start=k == 0, end=k == len(self.sizes) - 1, rules=rules, n_feats=n_feats)
        names = frozenset(arrays)
        if k == 0 and self.utt.voice_id:   # a START by voice id (the server resolves it to these prompt tensors)
            req.voice = self.utt.voice_id
            names = frozenset(self.utt.request(lo, lo + self.sizes[k], start=True, by_voice_id=True))
        return req, names

    def result(self) -> StreamResult:
        mel = np.concatenate(self.mels, axis=1) if self.mels else np.zeros((0, 0), np.float32)
        return StreamResult(mel=mel, chunk_latencies_s=self.latencies, chunk_frames=self.frames,
                            wall_s=(self.done_at or self.start_at) - self.start_at, error=self.error,
                            frames_expected=TOKEN_MEL_RATIO * len(self.utt.speech_tokens))


def run_streams(server: VirtualServer, utterances: Sequence[Utterance], starts: Sequence[float],
                rules: RequestRules = RequestRules()) -> list[StreamResult]:
    """Stream ``utterances`` through ``server``, the k-th starting at ``starts[k]`` (virtual seconds); one
    ``StreamResult`` each, as the real client's."""
    n_feats = server.n_feats
    half = server.host.transit_s / 2
    streams = [_Stream(k + 1, u, at) for k, (u, at) in enumerate(zip(utterances, starts))]
    order = itertools.count()
    events: list = []   # (time, order, kind, stream): "send" from the client, "answer" reaching it

    def send(s: _Stream, at: float) -> None:
        s.sent_at = at
        req, names = s.request(rules, n_feats)
        s.sent += 1
        server.offer(at + half, s.corr_id, req, names)

    for s in streams:
        heapq.heappush(events, (s.start_at, next(order), "send", s, None))
    by_id = {s.corr_id: s for s in streams}
    while True:
        t_server = server.next_time()
        if events and (t_server is None or events[0][0] <= t_server):
            at, _, kind, s, outcome = heapq.heappop(events)
            if kind == "send":
                send(s, at)
                continue
            if not hasattr(outcome, "mel"):   # an error: the stream stops there
                s.error, s.done_at = f"sequence {s.corr_id}: {outcome}", at
                continue
            s.latencies.append(at - s.sent_at)
            s.frames.append(int(outcome.mel.shape[1]))
            s.mels.append(outcome.mel)
            if s.sent < len(s.sizes):
                send(s, at)
            else:
                s.done_at = at
            continue
        if t_server is None:
            break
        for t, corr_id, outcome in server.step():
            heapq.heappush(events, (t + half, next(order), "answer", by_id[corr_id], outcome))
    return [s.result() for s in streams]
