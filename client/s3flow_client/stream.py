"""Stream speech tokens to the ``token2mel`` ensemble over gRPC and assemble the mel as it comes back.

One Triton sequence (correlation id) per utterance; several utterances share one gRPC stream. Each
utterance's next chunk is sent when the previous chunk's response arrived (what a client fed by a token
generator does), so per-chunk latency is well defined. Every response's frame offset is checked: no gap,
no duplicate, and 2 frames per token after the END request.

An error answer names its sequence (the server's messages say ``sequence N``), so it fails that utterance
only; the others on the stream go on. When the server says a chunk may be sent again (a failed model call
on a middle chunk or a START leaves the sequence as it was), the client sends it again, up to
``max_retries`` times with doubling back-off; ``StreamResult.retries`` counts them.

Example::

    from s3flow_client import StreamingClient, Utterance, chunk_schedule
    client = StreamingClient("127.0.0.1:8001")
    [result] = client.synthesize([Utterance(speech_tokens, prompt_tokens, prompt_mel, xvector, seed=0)])
    result.mel            # (80, 2 * len(speech_tokens))
    result.first_chunk_s, result.rtf

The ``token2wav`` ensemble answers audio as well: each response's newly final samples and their
``sample_offset``, checked like the frames (no gap, no duplicate, 480 samples per frame after END)::

    client = StreamingClient("127.0.0.1:8001", model="token2wav")
    [result] = client.synthesize([utt], on_audio=lambda i, samples: wav.write(samples))
    result.audio          # (480 * 2 * len(speech_tokens),) float32, 24 kHz
"""
from __future__ import annotations

import itertools
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

FRAMES_PER_TOKEN = 2
FRAMES_PER_SECOND = 50.0
SAMPLES_PER_FRAME = 480                # 24 kHz audio from token2wav
_corr_ids = itertools.count(int(time.time() * 1000) % (1 << 40) * 1000 + 1)
#: gRPC metadata naming the stream's first sequence id: a load balancer hashing on it (docker/k8s/) keeps
#: every chunk of the stream's utterances on one server, which sequence batching requires.
SEQUENCE_HEADER = "x-sequence-id"


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
    audio: Optional[np.ndarray] = None  # (samples,) assembled, token2wav only
    chunk_samples: list = field(default_factory=list)
    first_audio_s: float = float("nan")  # from the first request to the first non-empty audio
    retries: list = field(default_factory=list)  # the server errors after which a chunk was sent again

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
        self.audio_parts: list[np.ndarray] = []
        self.samples = 0
        self.first_audio_at = float("nan")
        self.retries: list[str] = []

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

    def where(self) -> str:
        """Where this utterance stopped, for error messages."""
        return (f"sequence {self.corr_id} reached frame {self.frames} of {2 * sum(self.sizes)} "
                f"(chunk {self.next_chunk + 1} of {len(self.sizes)} in flight)")

    def accept(self, mel: np.ndarray, offset: int) -> None:
        if offset != self.frames:
            raise ValueError(f"sequence {self.corr_id}: frame offset {offset} does not continue the "
                             f"{self.frames} frames received (gap or duplicate)")
        self.parts.append(mel)
        self.frames += mel.shape[1]

    def accept_audio(self, audio: np.ndarray, offset: int, now: float) -> None:
        if offset != self.samples:
            raise ValueError(f"sequence {self.corr_id}: sample offset {offset} does not continue the "
                             f"{self.samples} samples received (gap or duplicate)")
        self.audio_parts.append(audio)
        self.samples += audio.size
        if audio.size and self.first_audio_at != self.first_audio_at:
            self.first_audio_at = now - self.t0


class StreamingClient:
    """A gRPC streaming client of the ``token2mel`` model.

    Args:
        url: the server's gRPC ``host:port``.
        model: the entry model.
        timeout_s: bound on one ``synthesize`` call as a whole (also the gRPC stream's deadline).
        response_timeout_s: bound on the wait for the next response while chunks are in flight (a hung
            server is reported after this long, not only at ``timeout_s``); None: only ``timeout_s``.
        max_retries: how often one utterance may send a chunk again that the server said it may retry.
        retry_backoff_s: the wait before the first retry; it doubles with each retry of the utterance.
    """

    def __init__(self, url: str = "127.0.0.1:8001", model: str = "token2mel", timeout_s: float = 120.0,
                 response_timeout_s: Optional[float] = None, audio: Optional[bool] = None,
                 max_retries: int = 3, retry_backoff_s: float = 0.25):
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.audio = model.startswith("token2wav") if audio is None else audio  # ask for audio + sample_offset
        self.response_timeout_s = response_timeout_s

    def synthesize(self, utterances: Sequence[Utterance],
                   progress: Optional[Callable[[int], None]] = None,
                   on_audio: Optional[Callable[[int, np.ndarray], None]] = None) -> list[StreamResult]:
        """Stream all utterances at once over one gRPC stream; return one result per utterance.

        ``on_audio(i, samples)`` (audio models) gets utterance i's newly final samples as they arrive.

        Raises StreamError (with the partial results) if any utterance failed, the server went away or
        stopped answering; each message says at which frame (and chunk) its utterance stopped, and each
        result keeps the frames that arrived before.
        """
        streams = {next(_corr_ids): None for _ in utterances}
        streams = {cid: _Stream(u, cid) for cid, u in zip(streams, utterances)}
        events: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: events.put((result, error)),
                            stream_timeout=self.timeout_s, headers={SEQUENCE_HEADER: str(next(iter(streams), 0))})
        lock = threading.Lock()

        def send(s: _Stream) -> bool:
            """Send s's next chunk; False (s failed) if the stream broke already (server gone)."""
            i = s.next_chunk
            s.sent_at = time.perf_counter()
            try:
                client.async_stream_infer(self.model, s.inputs(), request_id=f"{s.corr_id}:{i}",
                                          sequence_id=s.corr_id, sequence_start=(i == 0),
                                          sequence_end=(i == len(s.sizes) - 1),
                                          outputs=[grpcclient.InferRequestedOutput(n) for n in outputs])
            except InferenceServerException as exc:  # the cause comes through the callback: see below
                s.error, s.done = f"{s.where()}: {exc}", True
                broken.append(s)
                return False
            return True

        broken: list[_Stream] = []

        outputs = ["mel", "frame_offset"] + (["audio", "sample_offset"] if self.audio else [])
        index = {cid: i for i, cid in enumerate(streams)}

        try:
            start = time.perf_counter()
            pending = 0
            for s in streams.values():
                s.t0 = start
                pending += send(s)
            deadline = start + self.timeout_s
            last_event = start
            retry_at: list[tuple[float, _Stream]] = []  # chunks to send again, when (no blocking wait)
            while pending:
                now = time.perf_counter()
                for due, s in [r for r in retry_at if r[0] <= now]:
                    retry_at.remove((due, s))
                    if not send(s):
                        pending -= 1
                wait = deadline - now
                if self.response_timeout_s is not None:
                    wait = min(wait, last_event + self.response_timeout_s - now)
                if retry_at:
                    wait = min(wait, min(due for due, _ in retry_at) - now)
                try:
                    result, error = events.get(timeout=max(wait, 0.01))
                except queue.Empty:
                    if retry_at and time.perf_counter() < deadline:
                        continue  # a retry is due, not a silent server
                    bound = (f"{self.timeout_s} s in all" if time.perf_counter() >= deadline
                             else f"{self.response_timeout_s} s since the last one")
                    for s in streams.values():
                        if not s.done:
                            s.error = f"{s.where()}: no response within {bound}"
                            s.done = True
                    break
                now = last_event = time.perf_counter()
                if result is None:
                    # tritonclient hands over stream errors and failed requests alike without the request
                    # id; the server's messages name the sequence: fail (or retry) that one only
                    s = _named_sequence(error, streams)
                    if s is None:  # the stream itself broke, or an error we cannot place: fail all open
                        for s in streams.values():
                            if not s.done:
                                s.error, s.done = f"{s.where()}: {error}", True
                        break
                    with lock:
                        if _retryable(error) and len(s.retries) < self.max_retries:
                            s.retries.append(str(error))
                            retry_at.append((now + self.retry_backoff_s * 2 ** (len(s.retries) - 1), s))
                        else:
                            s.error, s.done = f"{s.where()}: {error}", True
                            pending -= 1
                    continue
                rid = result.get_response().id
                cid = int(rid.split(":")[0])
                s = streams[cid]
                with lock:
                    if error is not None:
                        s.error, s.done = f"{s.where()}: {error}", True
                        pending -= 1
                        continue
                    s.latencies.append(now - s.sent_at)
                    try:
                        s.accept(result.as_numpy("mel")[0], int(result.as_numpy("frame_offset").reshape(-1)[0]))
                        if self.audio:
                            audio = result.as_numpy("audio").reshape(-1)
                            s.accept_audio(audio, int(result.as_numpy("sample_offset").reshape(-1)[0]), now)
                            if on_audio and audio.size:
                                on_audio(index[cid], audio)
                    except ValueError as exc:
                        s.error, s.done = str(exc), True
                        pending -= 1
                        continue
                    if progress:
                        progress(1)
                    s.next_chunk += 1
                    if s.next_chunk < len(s.sizes):
                        if not send(s):
                            pending -= 1
                    else:
                        s.done = True
                        s.wall = now - s.t0
                        pending -= 1
        finally:
            client.stop_stream(cancel_requests=True)  # joins the response thread: every callback is in
            client.close()
        causes = [error for result, error in _drain(events) if result is None and error is not None]
        for s in broken:
            if causes:
                s.error = f"{s.where()}: {causes[0]}"

        results = []
        for s in streams.values():
            expected = FRAMES_PER_TOKEN * len(s.utt.speech_tokens)
            mel = np.concatenate(s.parts, axis=1) if s.parts else np.zeros((0, 0), np.float32)
            if s.error is None and s.frames != expected:
                s.error = f"sequence {s.corr_id}: got {s.frames} frames, expected {expected} (2 per token)"
            if self.audio and s.error is None and s.samples != SAMPLES_PER_FRAME * s.frames:
                s.error = (f"sequence {s.corr_id}: got {s.samples} samples for {s.frames} frames, expected "
                           f"{SAMPLES_PER_FRAME * s.frames} ({SAMPLES_PER_FRAME} per frame)")
            audio = (np.concatenate(s.audio_parts) if s.audio_parts else np.zeros(0, np.float32)) if self.audio else None
            results.append(StreamResult(mel=mel, chunk_latencies_s=s.latencies,
                                        chunk_frames=[p.shape[1] for p in s.parts],
                                        wall_s=getattr(s, "wall", time.perf_counter() - s.t0),
                                        error=s.error, frames_expected=expected, audio=audio,
                                        chunk_samples=[p.size for p in s.audio_parts],
                                        first_audio_s=s.first_audio_at, retries=s.retries))
        failed = [r.error for r in results if r.error]
        if failed:
            raise StreamError("; ".join(failed), results)
        return results


_SEQUENCE = re.compile(r"sequence (\d+)")
#: What the solver says when a chunk left its sequence as it was (s3flow.session).
_RETRY_HINTS = ("send it again", "send the START again")


def _named_sequence(error, streams: dict) -> Optional[_Stream]:
    """The open utterance an error message names (``sequence N``), or None."""
    for m in _SEQUENCE.finditer(str(error)):
        s = streams.get(int(m.group(1)))
        if s is not None and not s.done:
            return s
    return None


def _retryable(error) -> bool:
    """The server said the chunk left its sequence as it was and may be sent again."""
    return any(h in str(error) for h in _RETRY_HINTS)


def _drain(events: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(events.get_nowait())
        except queue.Empty:
            return out


def save_mel_png(mel: np.ndarray, path, title: str = "", truth: Optional[np.ndarray] = None) -> None:
    """Write a spectrogram picture of mel (n_feats, frames); with ``truth`` (n_feats, frames), the ground
    truth above it on the same colour scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ground truth", truth)] if truth is not None else []
    panels.append((title or f"mel {mel.shape[0]} x {mel.shape[1]} frames", mel))
    lo = min(float(m.min()) for _, m in panels)
    hi = max(float(m.max()) for _, m in panels)
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(max(6.0, mel.shape[1] / 50.0), 0.4 + 2.8 * len(panels)))
    for ax, (name, m) in zip(axes[:, 0], panels):
        im = ax.imshow(m, origin="lower", aspect="auto", interpolation="nearest", cmap="magma", vmin=lo, vmax=hi,
                       extent=[0, m.shape[1] / FRAMES_PER_SECOND, 0, m.shape[0]])
        ax.set_ylabel("mel bin")
        ax.set_title(name)
        fig.colorbar(im, ax=ax)
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
