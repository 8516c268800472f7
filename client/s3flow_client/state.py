"""The client's book-keeping of one utterance: what was delivered, and where its current attempt stands.

An attempt is one Triton sequence (correlation id) on one server; a resume starts a new attempt, from the last
snapshot the server gave (its START carries it and the chunk after it) or replaying the chunks answered before.
Frames (and samples) are delivered once: those a replay computes again are compared with the delivered ones
(``replay_tolerance``) and dropped (see ``s3flow_client.resume``).
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Optional

import numpy as np

from s3flow_contract.tensors import FRAMES_PER_SECOND, SAMPLES_PER_FRAME, SILENT_START_SAMPLES
from s3flow_contract.tensors import TOKEN_MEL_RATIO as FRAMES_PER_TOKEN

_corr_ids = itertools.count(int(time.time() * 1000) % (1 << 40) * 1000 + 1)


def new_corr_id() -> int:
    """A correlation id no other attempt of this process uses (and other processes very likely do not)."""
    return next(_corr_ids)


class UtteranceState:
    """Book-keeping for one utterance: what was delivered, and where its current attempt stands.

    ``chunks``: the planned chunk sizes (every token in hand, ``ended``), or a live chunker
    (``s3flow_client.chunking.LiveChunks``): tokens then arrive by ``push`` until ``finish``, ``sizes`` grows
    as chunks are chosen, and the chunk that sends the last token after ``finish`` carries the END.
    """

    def __init__(self, index: int, utt, chunks, tolerance: float):
        self.index, self.utt, self.tolerance = index, utt, tolerance
        self.live = not isinstance(chunks, (list, tuple))
        self.chunker = chunks if self.live else None
        self.sizes: list[int] = [] if self.live else list(chunks)   # chunk sizes sent (a resume replays them)
        self.ended = not self.live
        self.pushed_at: list[tuple[float, int]] = []   # (time, tokens so far) of recent pushes (live)
        self.in_flight = False                         # a chunk of this attempt awaits its answer
        self.end_chunk: Optional[int] = None           # the chunk this attempt sent with the END flag
        self.recheck_at: Optional[float] = None        # when a live chunker wants to decide again
        self.first_frame_at = float("nan")
        self.sink = None                               # live: receives each delivery (see s3flow_client.live)
        self.corr_id, self.url_i, self.conn = new_corr_id(), 0, None
        self.next_chunk, self.answered = 0, 0          # chunk to send in this attempt; chunks ever answered
        self.first_chunk = 0                           # this attempt's START chunk (after its snapshot's)
        #: the last snapshot an answer carried: (bytes, chunks it covers, frames and samples the server had sent)
        self.snapshot: Optional[tuple[bytes, int, int, int]] = None
        self.use_snapshots = True                      # False once a server refused one: replay instead
        self.replayed_chunks = 0
        #: the Euler steps each answered chunk was solved at (its answer's ``steps``; 0: not said): a replay
        #: sends them back, so the server makes the same frames (a late chunk may have been given fewer)
        self.chunk_steps: list[int] = []
        self.server_frames = self.server_samples = 0   # what this attempt's responses covered
        self.parts: list[np.ndarray] = []              # delivered mel, in order
        self.audio_parts: list[np.ndarray] = []
        self.frames = self.samples = 0                 # delivered
        self.latencies: list[float] = []
        self.sent_at = self.t0 = 0.0
        self.admitted_after = 0.0                      # from the start to sending the START that was admitted
        self.error_after = float("nan")                # from sending a request to the server's error answering it
        self.first_audio_at = float("nan")
        self.error: Optional[str] = None
        self.done = False
        self.wall: Optional[float] = None
        self.retries: list[str] = []
        self.resumes: list[str] = []
        self.replayed_frames, self.replay_max_diff = 0, 0.0
        self.by_voice_id = utt.voice_id is not None   # START names the voice; False: it carries the prompt

    # -- live tokens ----------------------------------------------------------------------------------
    def push(self, tokens: np.ndarray, now: float) -> None:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if self.ended:
            raise ValueError(f"utterance {self.index}: push after end()")
        self.utt.speech_tokens = np.concatenate([self.utt.speech_tokens, tokens])
        self.pushed_at = [p for p in self.pushed_at if now - p[0] < 2.0] + [(now, len(self.utt.speech_tokens))]

    def finish(self) -> None:
        self.ended = True

    @property
    def unsent(self) -> int:
        return len(self.utt.speech_tokens) - sum(self.sizes)

    def token_rate(self) -> Optional[float]:
        """Tokens per second over the recent pushes (None: too few to say)."""
        if len(self.pushed_at) < 2 or self.pushed_at[-1][0] - self.pushed_at[0][0] < 0.1:
            return None
        (t0, n0), (t1, n1) = self.pushed_at[0], self.pushed_at[-1]
        return (n1 - n0) / (t1 - t0)

    def lead_s(self, now: float, audio: bool = False) -> float:
        """Output delivered and not yet played, if playback began with the first delivered frame (``audio``:
        the first delivered samples beyond the silent start, and the samples delivered)."""
        if audio:
            if math.isnan(self.first_audio_at):
                return 0.0
            return self.samples / (SAMPLES_PER_FRAME * FRAMES_PER_SECOND) - (now - self.t0 - self.first_audio_at)
        if math.isnan(self.first_frame_at):
            return 0.0
        return self.frames / FRAMES_PER_SECOND - (now - self.first_frame_at)

    def is_end(self, i: int) -> bool:
        """Chunk i carries the END: the last planned one, or (live) the one that sends the last token after
        ``finish``."""
        if not self.live:
            return i == len(self.sizes) - 1
        return self.ended and sum(self.sizes[:i + 1]) == len(self.utt.speech_tokens)

    def tensors(self) -> dict:
        """The tensors of this attempt's next chunk (a START carries the voice id or the prompt, the options, and
        for a resume from a snapshot the snapshot)."""
        i = self.next_chunk
        lo = sum(self.sizes[:i])
        start = i == self.first_chunk
        resume = self.snapshot[0] if start and self.first_chunk else None
        steps = self.chunk_steps[i] if i < len(self.chunk_steps) and self.chunk_steps[i] > 0 else None
        return self.utt.request(lo, lo + self.sizes[i], start=start, by_voice_id=self.by_voice_id, resume=resume,
                                chunk_steps=steps)

    def keep_steps(self, steps: Optional[np.ndarray], chunk: int) -> None:
        """The Euler steps the answer to chunk ``chunk`` (answered for the first time) says it was solved at."""
        if chunk == len(self.chunk_steps):
            self.chunk_steps.append(0 if steps is None else int(steps.reshape(-1)[0]))

    def keep_snapshot(self, snapshot: Optional[np.ndarray], chunk: int) -> None:
        """The snapshot answered with chunk ``chunk`` (if any): a resume goes on from it."""
        blob = b"" if snapshot is None else snapshot.reshape(-1)[0]
        if isinstance(blob, bytes) and blob:
            self.snapshot = (blob, chunk + 1, self.server_frames, self.server_samples)

    def start_attempt(self, from_snapshot: bool) -> None:
        """A new attempt (a new correlation id, set by the caller) begins: from the snapshot (the chunk after it
        is its START) or from the first chunk (every answered chunk replayed)."""
        if from_snapshot and self.snapshot is not None:
            _, covered, self.server_frames, self.server_samples = self.snapshot
            self.first_chunk = self.next_chunk = covered
        else:
            self.first_chunk = self.next_chunk = 0
            self.server_frames = self.server_samples = 0
        self.replayed_chunks += max(self.answered - self.first_chunk, 0)

    def where(self) -> str:
        total = FRAMES_PER_TOKEN * len(self.utt.speech_tokens)
        more = "" if self.ended else " so far"
        return (f"sequence {self.corr_id} reached frame {self.frames} of {total}{more} "
                f"(chunk {self.next_chunk + 1} of {len(self.sizes)}{more} in flight)")

    def _merge(self, got: np.ndarray, offset: int, have: int, parts: list, axis: int, what: str) -> np.ndarray:
        """The part of ``got`` (starting at ``offset``) beyond the ``have`` delivered; the rest must agree."""
        n = min(max(have - offset, 0), got.shape[axis])
        if n:
            old = np.concatenate(parts, axis=axis).take(range(offset, offset + n), axis=axis)
            diff = float(np.max(np.abs(old - got.take(range(n), axis=axis))))
            self.replay_max_diff = max(self.replay_max_diff, diff)
            if not diff <= self.tolerance:
                raise ValueError(f"sequence {self.corr_id}: replayed {what} {offset}..{offset + n} differ from "
                                 f"the delivered ones by {diff:.3g} (replay_tolerance {self.tolerance}): not "
                                 f"splicing two different syntheses")
        return got.take(range(n, got.shape[axis]), axis=axis)

    def accept(self, mel: np.ndarray, offset: int, new_chunk: bool) -> np.ndarray:
        """A response's frames: those delivered already are checked; a new chunk's part is kept (even empty)
        and returned."""
        if offset != self.server_frames:
            raise ValueError(f"sequence {self.corr_id}: frame offset {offset} does not continue the "
                             f"{self.server_frames} frames received (gap or duplicate)")
        self.server_frames += mel.shape[1]
        new = self._merge(mel, offset, self.frames, self.parts, 1, "frames")
        self.replayed_frames += mel.shape[1] - new.shape[1]
        if new_chunk or new.shape[1]:
            self.parts.append(new)
            self.frames += new.shape[1]
            if math.isnan(self.first_frame_at) and new.shape[1]:
                self.first_frame_at = time.perf_counter()
        return new

    def accept_audio(self, audio: np.ndarray, offset: int, now: float, new_chunk: bool) -> np.ndarray:
        """Returns the newly delivered samples."""
        if offset != self.server_samples:
            raise ValueError(f"sequence {self.corr_id}: sample offset {offset} does not continue the "
                             f"{self.server_samples} samples received (gap or duplicate)")
        self.server_samples += audio.size
        new = self._merge(audio, offset, self.samples, self.audio_parts, 0, "samples")
        if new_chunk or new.size:
            self.audio_parts.append(new)
            self.samples += new.size
            if math.isnan(self.first_audio_at) and self.samples > SILENT_START_SAMPLES:
                self.first_audio_at = now - self.t0
        return new

