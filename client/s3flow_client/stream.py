"""Stream speech tokens to the ``token2mel`` ensemble over gRPC and assemble the mel as it comes back.

One Triton sequence (correlation id) per utterance; several utterances share one gRPC stream. Each
utterance's next chunk is sent when the previous chunk's response arrived (what a client fed by a token
generator does), so per-chunk latency is well defined. Every response's frame offset is checked: no gap,
no duplicate, and 2 frames per token after the END request.

Example::

    from s3flow_client import StreamingClient, Utterance, chunk_schedule
    client = StreamingClient("127.0.0.1:8001")
    [result] = client.synthesize([Utterance(speech_tokens, prompt_tokens, prompt_mel, xvector, seed=0)])
    result.mel            # (80, 2 * len(speech_tokens))
    result.first_chunk_s, result.rtf
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import tritonclient.grpc as grpcclient

FRAMES_PER_TOKEN = 2
FRAMES_PER_SECOND = 50.0
_corr_ids = itertools.count(int(time.time() * 1000) % (1 << 40) * 1000 + 1)


def chunk_schedule(n_tokens: int, first: int = 10, growth: float = 2.0, largest: int = 100) -> list[int]:
    """Chunk sizes summing to n_tokens: a small first chunk (fast first audio), then growing ones."""
    if first < 1 or largest < first or growth < 1:
        raise ValueError(f"need 1 <= first <= largest and growth >= 1, got {first}, {largest}, {growth}")
    sizes, size, left = [], float(first), n_tokens
    while left > 0:
        take = min(int(size), left)
        sizes.append(take)
        left -= take
        size = min(size * growth, largest)
    return sizes


@dataclass
class Utterance:
    """One utterance to synthesise: speech tokens (N,), the speaker prompt and options."""
    speech_tokens: np.ndarray
    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray            # (2 Np, 80) frames-major
    speaker_embedding: np.ndarray     # (192,)
    seed: int = 0
    n_timesteps: Optional[int] = None
    guidance_rate: Optional[float] = None
    chunks: Optional[list[int]] = None  # default: chunk_schedule(len(speech_tokens))


@dataclass
class StreamResult:
    mel: np.ndarray                   # (n_feats, frames) assembled
    chunk_latencies_s: list[float]
    chunk_frames: list[int]
    wall_s: float
    error: Optional[str] = None
    frames_expected: int = 0

    @property
    def first_chunk_s(self) -> float:
        return self.chunk_latencies_s[0] if self.chunk_latencies_s else float("nan")

    @property
    def audio_s(self) -> float:
        return self.mel.shape[1] / FRAMES_PER_SECOND

    @property
    def rtf(self) -> float:
        """Real-time factor: wall time over audio time (below 1 is faster than real time)."""
        return self.wall_s / self.audio_s if self.audio_s else float("inf")


class StreamError(RuntimeError):
    """The server answered an error or a response broke the frame order; ``.results`` keeps what arrived."""

    def __init__(self, message: str, results):
        super().__init__(message)
        self.results = results


class _Stream:
    """Book-keeping for one utterance in flight."""

    def __init__(self, utt: Utterance, corr_id: int):
        self.utt, self.corr_id = utt, corr_id
        self.sizes = utt.chunks or chunk_schedule(len(utt.speech_tokens))
        if sum(self.sizes) != len(utt.speech_tokens) or min(self.sizes, default=1) < 0:
            raise ValueError(f"chunk sizes {self.sizes} do not add up to {len(utt.speech_tokens)} tokens")
        self.next_chunk, self.sent_at, self.t0 = 0, 0.0, 0.0
        self.parts: list[np.ndarray] = []
        self.frames = 0
        self.latencies: list[float] = []
        self.error: Optional[str] = None
        self.done = False

    def inputs(self) -> list:
        i, u = self.next_chunk, self.utt
        lo = sum(self.sizes[:i])
        tensors = {"speech_tokens": u.speech_tokens[lo:lo + self.sizes[i]].astype(np.int64)[None]}
        if i == 0:
            tensors.update(prompt_tokens=u.prompt_tokens.astype(np.int64)[None],
                           prompt_mel=u.prompt_mel.astype(np.float32)[None],
                           speaker_embedding=u.speaker_embedding.astype(np.float32).reshape(1, -1),
                           seed=np.array([[u.seed]], dtype=np.int64))
            if u.n_timesteps is not None:
                tensors["n_timesteps"] = np.array([[u.n_timesteps]], dtype=np.int32)
            if u.guidance_rate is not None:
                tensors["guidance_rate"] = np.array([[u.guidance_rate]], dtype=np.float32)
        out = []
        for name, value in tensors.items():
            t = grpcclient.InferInput(name, list(value.shape), {np.int64: "INT64", np.int32: "INT32",
                                                               np.float32: "FP32"}[value.dtype.type])
            t.set_data_from_numpy(value)
            out.append(t)
        return out

    def accept(self, mel: np.ndarray, offset: int) -> None:
        if offset != self.frames:
            raise ValueError(f"sequence {self.corr_id}: frame offset {offset} does not continue the "
                             f"{self.frames} frames received (gap or duplicate)")
        self.parts.append(mel)
        self.frames += mel.shape[1]


class StreamingClient:
    """A gRPC streaming client of the ``token2mel`` model."""

    def __init__(self, url: str = "127.0.0.1:8001", model: str = "token2mel", timeout_s: float = 120.0):
        self.url, self.model, self.timeout_s = url, model, timeout_s

    def synthesize(self, utterances: Sequence[Utterance],
                   progress: Optional[Callable[[int], None]] = None) -> list[StreamResult]:
        """Stream all utterances at once over one gRPC stream; return one result per utterance.

        Raises StreamError (with the partial results) if any utterance failed.
        """
        streams = {next(_corr_ids): None for _ in utterances}
        streams = {cid: _Stream(u, cid) for cid, u in zip(streams, utterances)}
        events: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: events.put((result, error)),
                            stream_timeout=self.timeout_s)
        lock = threading.Lock()

        def send(s: _Stream):
            i = s.next_chunk
            s.sent_at = time.perf_counter()
            client.async_stream_infer(self.model, s.inputs(), request_id=f"{s.corr_id}:{i}",
                                      sequence_id=s.corr_id, sequence_start=(i == 0),
                                      sequence_end=(i == len(s.sizes) - 1),
                                      outputs=[grpcclient.InferRequestedOutput("mel"),
                                               grpcclient.InferRequestedOutput("frame_offset")])

        try:
            start = time.perf_counter()
            for s in streams.values():
                s.t0 = start
                send(s)
            pending = len(streams)
            deadline = start + self.timeout_s
            while pending:
                try:
                    result, error = events.get(timeout=max(deadline - time.perf_counter(), 0.01))
                except queue.Empty:
                    for s in streams.values():
                        if not s.done:
                            s.error = (f"no response within {self.timeout_s} s (chunk {s.next_chunk}, "
                                       f"{s.frames} frames received)")
                            s.done = True
                    break
                now = time.perf_counter()
                if result is None:  # a stream-level error: we cannot tell which request, fail the rest
                    for s in streams.values():
                        if not s.done:
                            s.error, s.done = f"stream error after {s.frames} frames: {error}", True
                    break
                rid = result.get_response().id
                cid = int(rid.split(":")[0])
                s = streams[cid]
                with lock:
                    if error is not None:
                        s.error, s.done = f"chunk {s.next_chunk} failed after {s.frames} frames: {error}", True
                        pending -= 1
                        continue
                    s.latencies.append(now - s.sent_at)
                    try:
                        s.accept(result.as_numpy("mel")[0], int(result.as_numpy("frame_offset").reshape(-1)[0]))
                    except ValueError as exc:
                        s.error, s.done = str(exc), True
                        pending -= 1
                        continue
                    if progress:
                        progress(1)
                    s.next_chunk += 1
                    if s.next_chunk < len(s.sizes):
                        send(s)
                    else:
                        s.done = True
                        s.wall = now - s.t0
                        pending -= 1
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()

        results = []
        for s in streams.values():
            expected = FRAMES_PER_TOKEN * len(s.utt.speech_tokens)
            mel = np.concatenate(s.parts, axis=1) if s.parts else np.zeros((0, 0), np.float32)
            if s.error is None and s.frames != expected:
                s.error = f"sequence {s.corr_id}: got {s.frames} frames, expected {expected} (2 per token)"
            results.append(StreamResult(mel=mel, chunk_latencies_s=s.latencies,
                                        chunk_frames=[p.shape[1] for p in s.parts],
                                        wall_s=getattr(s, "wall", time.perf_counter() - s.t0),
                                        error=s.error, frames_expected=expected))
        failed = [r.error for r in results if r.error]
        if failed:
            raise StreamError("; ".join(failed), results)
        return results


def save_mel_png(mel: np.ndarray, path, title: str = "") -> None:
    """Write a spectrogram picture of mel (n_feats, frames)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, mel.shape[1] / 50.0), 3.2))
    im = ax.imshow(mel, origin="lower", aspect="auto", interpolation="nearest", cmap="magma",
                   extent=[0, mel.shape[1] / FRAMES_PER_SECOND, 0, mel.shape[0]])
    ax.set_xlabel("time (s)")
    ax.set_ylabel("mel bin")
    ax.set_title(title or f"mel {mel.shape[0]} x {mel.shape[1]} frames")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
