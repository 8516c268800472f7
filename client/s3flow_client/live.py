"""Utterances fed live: push tokens as a text-to-token model makes them, take mel and audio as they come.

Example (a T3-like generator; any thread may push)::

    from s3flow_client import LiveClient
    with LiveClient("127.0.0.1:8001", model="token2wav") as client:
        stream = client.open(voice_id="ab12...", seed=0)      # or prompt_tokens=, prompt_mel=, speaker_embedding=
        for tokens in generator():                            # any sizes
            stream.push(tokens)
        stream.end()
        for piece in stream:                                  # Piece(mel, frame_offset, audio, sample_offset)
            player.write(piece.audio)
        result = stream.result()                              # a StreamResult: first audio, stalls, retries ...

asyncio: ``push``, ``end`` and ``cancel`` never block, so a coroutine calls them directly; ``async for piece in
stream.pieces_async()`` and ``await stream.result_async()`` wait without blocking the event loop.

One background thread runs the client's event loop (``s3flow_client.resume.Run`` in live mode: the same loop
``StreamingClient.synthesize`` runs with every token in hand), so a live utterance has what a batch one has:
retries, resume on the next address with the same chunk boundaries (checked against what was delivered),
dispositions, voice fallback. The chunk sizes are chosen as tokens arrive (``s3flow_client.chunking.LiveChunks``)
and recorded in ``LiveStream.sizes``. ``cancel()`` ends the sequence on the server at once.

Stalls: ``StreamResult.stalls`` counts the times playback would have run dry, for a player that starts
``start_buffer_s`` after the first audio arrives and then plays in real time (``stall_s`` their total).
"""
from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from s3flow_contract.tensors import FRAMES_PER_SECOND

from .channel import Channel
from .chunking import LiveChunks
from .resume import Run
from .state import UtteranceState
from .stream import StreamError, StreamingClient, StreamResult, Utterance, dry_spells


@dataclass(frozen=True)
class Piece:
    """Newly final output of one response: ``mel`` (n_feats, F) from frame ``frame_offset``; ``audio`` (S,)
    from sample ``sample_offset`` (token2wav; None for token2mel); ``at_s`` seconds since the stream opened."""
    mel: np.ndarray
    frame_offset: int
    audio: Optional[np.ndarray]
    sample_offset: int
    at_s: float


def stalls(pieces: Sequence[Piece], start_buffer_s: float, per_second: float) -> tuple[int, float]:
    """``stream.dry_spells`` of the pieces (audio samples, or mel frames for token2mel, ``per_second``)."""
    return dry_spells(((p.at_s, (p.audio.size if p.audio is not None else p.mel.shape[1]) / per_second)
                       for p in pieces), start_buffer_s)


class LiveStream:
    """One live utterance (from ``LiveClient.open``)."""

    def __init__(self, client: "LiveClient", state: UtteranceState):
        self._client, self._state = client, state
        self._pieces: queue.Queue = queue.Queue()
        self._all: list[Piece] = []
        self._done = threading.Event()
        self._ended = False
        self._opened = time.perf_counter()
        state.sink = self._deliver

    # -- verbs (any thread, never blocking) -------------------------------------------------------------
    def push(self, tokens) -> None:
        if self._ended:
            raise ValueError(f"utterance {self._state.index}: push after end()")
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size:
            self._client._put("push", self._state, tokens.copy())

    def end(self) -> None:
        self._ended = True
        self._client._put("end", self._state)

    def cancel(self) -> None:
        """Stop: the server frees the utterance at once; iteration ends; ``result()`` holds the error."""
        self._client._put("cancel", self._state)

    # -- output ----------------------------------------------------------------------------------------
    def _deliver(self, mel, frame_offset, audio, sample_offset) -> None:  # the loop's thread
        if mel is None:
            self._done.set()
            self._pieces.put(None)
            return
        piece = Piece(mel, frame_offset, audio, sample_offset, time.perf_counter() - self._opened)
        self._all.append(piece)
        self._pieces.put(piece)

    def __iter__(self) -> Iterator[Piece]:
        while True:
            piece = self._pieces.get()
            if piece is None:
                self._pieces.put(None)  # later iterations end at once too
                return
            yield piece

    async def pieces_async(self):
        loop = asyncio.get_running_loop()
        while True:
            piece = await loop.run_in_executor(None, self._pieces.get)
            if piece is None:
                self._pieces.put(None)
                return
            yield piece

    @property
    def pieces(self) -> list[Piece]:
        """Every piece delivered so far, in order (also those already iterated)."""
        return list(self._all)

    @property
    def sizes(self) -> list[int]:
        """The chunk sizes sent so far (what a resume replays)."""
        return list(self._state.sizes)

    def result(self, timeout: Optional[float] = None, start_buffer_s: Optional[float] = None) -> StreamResult:
        """Wait until the utterance is done (or failed); its StreamResult with ``stalls`` / ``stall_s``."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"utterance {self._state.index} not done within {timeout} s")
        r = self._client._batch._result(self._state)
        buffer = self._client.start_buffer_s if start_buffer_s is None else start_buffer_s
        audio = self._client._batch.audio
        r.stalls, r.stall_s = stalls(self._all, buffer, 24000.0 if audio else FRAMES_PER_SECOND)
        return r

    async def result_async(self, timeout: Optional[float] = None) -> StreamResult:
        return await asyncio.get_running_loop().run_in_executor(None, self.result, timeout)


class LiveClient:
    """Live utterances over one event loop (a background thread), to one server or several (failover).

    Args: as ``StreamingClient`` (``url``, ``model``, ``channel``, ``response_timeout_s``, ``max_retries``,
    ``max_resumes`` ...), plus ``chunking`` (a ``LiveChunks``) and ``start_buffer_s``, the audio a player
    holds before it starts (for the stall figures).
    """

    def __init__(self, url: Union[str, Sequence[str]] = "127.0.0.1:8001", model: str = "token2wav",
                 chunking: Optional[LiveChunks] = None, start_buffer_s: float = 0.0,
                 channel: Optional[Channel] = None, **options):
        self._batch = StreamingClient(url, model, channel=channel, **options)
        self.chunking = chunking or LiveChunks()
        self.start_buffer_s = start_buffer_s
        self._run = Run(self._batch, [], None, None, live=True)
        self._thread: Optional[threading.Thread] = None
        self._count = 0
        self._lock = threading.Lock()

    def _put(self, kind: str, state: Optional[UtteranceState], arg=None) -> None:
        self._run.events.put((None, kind, (state, arg)))

    def open(self, prompt_tokens=None, prompt_mel=None, speaker_embedding=None, voice_id: Optional[str] = None,
             seed: int = 0, n_timesteps: Optional[int] = None, guidance_rate: Optional[float] = None,
             chunking: Optional[LiveChunks] = None) -> LiveStream:
        """A new utterance: a registered voice (``voice_id``) or a prompt (tokens, mel frames-major (2 Np, 80),
        x-vector); with both, the prompt is sent where a server does not hold the voice."""
        if voice_id is None and prompt_tokens is None:
            raise ValueError("open() needs a voice_id or a prompt (prompt_tokens, prompt_mel, speaker_embedding)")
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run.run, name="s3flow-live", daemon=True)
                self._thread.start()
            index, self._count = self._count, self._count + 1
        utt = Utterance(np.zeros(0, np.int64), prompt_tokens, prompt_mel, speaker_embedding, seed=seed,
                        n_timesteps=n_timesteps, guidance_rate=guidance_rate, voice_id=voice_id)
        state = UtteranceState(index, utt, chunking or self.chunking, self._batch.replay_tolerance)
        stream = LiveStream(self, state)
        self._put("open", state)
        return stream

    def close(self) -> None:
        """Stop the loop once the utterances in flight are done (an utterance not ended fails)."""
        if self._thread is None:
            return
        self._put("close", None)
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "LiveClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def synthesize_live(client: LiveClient, utterances: Sequence[Utterance], token_rate: float,
                    burst: int = 1) -> list[StreamResult]:
    """Feed each utterance's tokens at ``token_rate`` per second (``burst`` at a time, from one feeder thread
    per utterance, as T3 would), from its START; their results. A test and measuring aid."""
    streams = [client.open(u.prompt_tokens, u.prompt_mel, u.speaker_embedding, u.voice_id, u.seed, u.n_timesteps,
                           u.guidance_rate) for u in utterances]

    def feed(stream: LiveStream, tokens: np.ndarray) -> None:
        t0 = time.perf_counter()
        for k in range(0, len(tokens), burst):
            delay = t0 + (k + burst) / token_rate - time.perf_counter() if math.isfinite(token_rate) else 0
            if delay > 0:
                time.sleep(delay)
            stream.push(tokens[k:k + burst])
        stream.end()

    feeders = [threading.Thread(target=feed, args=(s, u.speech_tokens), daemon=True)
               for s, u in zip(streams, utterances)]
    for f in feeders:
        f.start()
    results = [s.result() for s in streams]
    for f in feeders:
        f.join()
    failed = [r.error for r in results if r.error]
    if failed:
        raise StreamError("; ".join(failed), results)
    return results
