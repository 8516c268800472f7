"""Stream speech tokens to the ``token2mel`` ensemble over gRPC and assemble the mel as it comes back.

One Triton sequence (correlation id) per utterance; several utterances share one gRPC stream. Each
utterance's next chunk is sent when the previous chunk's response arrived (what a client fed by a token
generator does), so per-chunk latency is well defined. Every response's frame offset is checked: no gap,
no duplicate, and 2 frames per token after the END request.

An error answer names its sequence (the server's messages say ``sequence N``), so it concerns that utterance
only; the others on the stream go on. When the server says a chunk may be sent again (a failed model call
on a middle chunk or a START leaves the sequence as it was, or the server is full), the client sends it
again, up to ``max_retries`` times with back-off; ``StreamResult.retries`` lists them. When the server lost
the utterance, went away or is draining, the client resumes it on the next address (``s3flow_client.resume``:
from the last snapshot the server gave, or by replay, frames checked against those delivered, none delivered
twice); ``StreamResult.resumes`` lists them::

    client = StreamingClient(["10.0.0.5:8001", "10.0.0.6:8001"])   # or "10.0.0.5:8001,10.0.0.6:8001"

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

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np

from s3flow_contract.tensors import FRAMES_PER_SECOND, SAMPLES_PER_FRAME, request_arrays

from .channel import Channel
from .chunking import chunk_schedule
from .resume import Run
from .state import FRAMES_PER_TOKEN, UtteranceState


def dry_spells(arrivals, start_buffer_s: float = 0.0) -> tuple[int, float]:
    """(times, seconds) a real-time player runs dry, given (arrival s, seconds of output) per response: it
    starts ``start_buffer_s`` after the first response with output and plays each as it arrives."""
    count, dry, until = 0, 0.0, None
    for t, seconds in arrivals:
        if seconds <= 0:
            continue
        if until is None:
            until = t + start_buffer_s
        elif t > until:
            count, dry, until = count + 1, dry + t - until, t
        until += seconds
    return count, dry


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
    #: a registered voice (s3flow_client.voices): the START names it instead of carrying the prompt; the
    #: prompt above is sent instead where a server does not hold that voice
    voice_id: Optional[str] = None

    def request(self, lo: int, hi: int, start: bool, by_voice_id: bool = False,
                resume: Optional[bytes] = None, chunk_steps: Optional[int] = None) -> dict[str, np.ndarray]:
        """The tensors of the chunk ``speech_tokens[lo:hi]`` (``s3flow_contract.tensors.request_arrays``), with
        its ``token_offset`` (so the server never applies it twice): a START carries the prompt (or,
        ``by_voice_id``, the voice id instead), the seed and the options, and for a resume the snapshot; a chunk
        replayed carries the Euler steps its first answer said (``chunk_steps``)."""
        tokens = self.speech_tokens[lo:hi]
        if not start:
            return request_arrays(tokens, token_offset=lo, chunk_steps=chunk_steps)
        prompt = (dict(voice_id=self.voice_id) if by_voice_id else
                  dict(prompt_tokens=self.prompt_tokens, prompt_mel=self.prompt_mel,
                       speaker_embedding=self.speaker_embedding))
        return request_arrays(tokens, start=True, seed=self.seed, n_timesteps=self.n_timesteps,
                              guidance_rate=self.guidance_rate, token_offset=lo, resume=resume,
                              chunk_steps=chunk_steps, **prompt)


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
    #: from the first request to the first response whose samples reach beyond the silent, faded-in first 40 ms
    #: (``s3flow_contract.tensors.SILENT_START_SAMPLES``): when a listener first hears something
    first_audio_s: float = float("nan")
    retries: list = field(default_factory=list)  # the server errors after which a chunk was sent again
    #: seconds from the start to sending the START the server admitted (0 unless refusals came first: busy, a
    #: full server's retry_after)
    admitted_after_s: float = 0.0
    #: seconds from sending the request the server last answered with an error to that answer (nan: none): how
    #: long a refusal took the server, without this client's own start-up (``wall_s`` has it)
    error_after_s: float = float("nan")
    resumes: list = field(default_factory=list)  # each time the utterance was replayed on a (new) server
    replayed_frames: int = 0          # frames computed again by resumes (the extra work), checked, not re-delivered
    replayed_chunks: int = 0          # chunks answered before and sent again by resumes (0 for a snapshot resume)
    replay_max_diff: float = 0.0      # largest difference between a delivered frame and its replayed copy
    #: live utterances (s3flow_client.live): times a real-time player starting ``start_buffer_s`` after the first
    #: audio would have run dry, and for how long in all
    stalls: int = 0
    stall_s: float = 0.0
    #: the correlation id the server knew the utterance by (its last, after resumes): what its logs, traces and
    #: records name it by
    corr_id: int = 0

    @property
    def first_chunk_s(self) -> float:
        return self.chunk_latencies_s[0] if self.chunk_latencies_s else float("nan")

    @property
    def audio_s(self) -> float:
        return self.mel.shape[1] / FRAMES_PER_SECOND

    def playback_stalls(self, start_buffer_s: float = 0.0) -> tuple[int, float]:
        """``dry_spells`` of this stream's responses. The batch client sends each chunk when the previous one is
        answered, so response k arrives at the sum of the first k+1 chunk latencies."""
        arrivals = np.cumsum(self.chunk_latencies_s) if self.chunk_latencies_s else []
        return dry_spells(zip(arrivals, (f / FRAMES_PER_SECOND for f in self.chunk_frames)), start_buffer_s)

    @property
    def rtf(self) -> float:
        """Real-time factor: wall time over audio time (below 1 is faster than real time)."""
        return self.wall_s / self.audio_s if self.audio_s else float("inf")


class StreamError(RuntimeError):
    """The server answered an error or a response broke the frame order; ``.results`` keeps what arrived."""

    def __init__(self, message: str, results):
        super().__init__(message)
        self.results = results


class StreamingClient:
    """A gRPC streaming client of the ``token2mel`` (or ``token2wav``) model.

    Args:
        url: the server's gRPC ``host:port``, or several (a list, or comma-separated): utterances start on
            the first; one whose server goes away resumes on the next (see ``s3flow_client.resume``).
        model: the entry model.
        timeout_s: bound on one ``synthesize`` call as a whole (also the gRPC streams' deadline); None (the
            default): none, so an utterance may stream for as long as it lasts.
        response_timeout_s: bound on the wait for the next response while chunks are in flight: a hung
            server is reported after this long (default 120 s); None: only ``timeout_s``.
        max_retries: how often one utterance may send a chunk again that the server said it may retry
            (or a START that a full server refused).
        retry_backoff_s: the wait before the first retry; it doubles with each retry of the utterance.
        max_resumes: how often one utterance may be resumed (as a new sequence) after its server lost it, went
            away or started draining.
        snapshots: resume from the last snapshot the server gave (the next chunk is all the work; the server
            must hold the fleet's snapshot key); False, or none given: replay every answered chunk.
        replay_tolerance: largest difference allowed between delivered frames (and samples) and their
            replayed copies after a resume.
        channel: TLS and the metadata every call carries (``s3flow_client.channel``; default: plain gRPC).
    """

    def __init__(self, url: Union[str, Sequence[str]] = "127.0.0.1:8001", model: str = "token2mel",
                 timeout_s: Optional[float] = None, response_timeout_s: Optional[float] = 120.0,
                 audio: Optional[bool] = None, max_retries: int = 3, retry_backoff_s: float = 0.25,
                 max_resumes: int = 3, replay_tolerance: float = 1e-3, channel: Optional[Channel] = None,
                 snapshots: bool = True):
        self.urls = [u.strip() for u in (url.split(",") if isinstance(url, str) else url) if u.strip()]
        if not self.urls:
            raise ValueError(f"no server address in {url!r}")
        self.url = self.urls[0]
        self.model, self.timeout_s = model, timeout_s
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.max_resumes, self.replay_tolerance, self.snapshots = max_resumes, replay_tolerance, snapshots
        self.audio = model.startswith("token2wav") if audio is None else audio  # ask for audio + sample_offset
        self.response_timeout_s = response_timeout_s
        self.channel = channel or Channel()

    def synthesize(self, utterances: Sequence[Utterance],
                   progress: Optional[Callable[[int], None]] = None,
                   on_audio: Optional[Callable[[int, np.ndarray], None]] = None) -> list[StreamResult]:
        """Stream all utterances at once; return one result per utterance.

        ``progress(1)`` is called for each newly answered chunk; ``on_audio(i, samples)`` (audio models)
        gets utterance i's newly final samples as they arrive (never twice, also across a resume).

        Raises StreamError (with the partial results) if any utterance failed for good; each message says
        at which frame (and chunk) its utterance stopped, and each result keeps the frames delivered before.
        """
        streams = []
        for i, u in enumerate(utterances):
            sizes = u.chunks or chunk_schedule(len(u.speech_tokens))
            if sum(sizes) != len(u.speech_tokens) or min(sizes, default=1) < 0:
                raise ValueError(f"chunk sizes {sizes} do not add up to {len(u.speech_tokens)} tokens")
            streams.append(UtteranceState(i, u, sizes, self.replay_tolerance))
        Run(self, streams, progress, on_audio).run()
        results = [self._result(s) for s in streams]
        failed = [r.error for r in results if r.error]
        if failed:
            raise StreamError("; ".join(failed), results)
        return results

    def _result(self, s: UtteranceState) -> StreamResult:
        expected = FRAMES_PER_TOKEN * len(s.utt.speech_tokens)
        mel = np.concatenate(s.parts, axis=1) if s.parts else np.zeros((0, 0), np.float32)
        if s.error is None and s.frames != expected:
            s.error = f"sequence {s.corr_id}: got {s.frames} frames, expected {expected} (2 per token)"
        if self.audio and s.error is None and s.samples != SAMPLES_PER_FRAME * s.frames:
            s.error = (f"sequence {s.corr_id}: got {s.samples} samples for {s.frames} frames, expected "
                       f"{SAMPLES_PER_FRAME * s.frames} ({SAMPLES_PER_FRAME} per frame)")
        audio = (np.concatenate(s.audio_parts) if s.audio_parts else np.zeros(0, np.float32)) if self.audio else None
        return StreamResult(mel=mel, chunk_latencies_s=s.latencies, chunk_frames=[p.shape[1] for p in s.parts],
                            wall_s=s.wall if s.wall is not None else time.perf_counter() - s.t0,
                            error=s.error, frames_expected=expected, audio=audio,
                            chunk_samples=[p.size for p in s.audio_parts], first_audio_s=s.first_audio_at,
                            retries=s.retries, admitted_after_s=s.admitted_after, error_after_s=s.error_after,
                            resumes=s.resumes,
                            replayed_frames=s.replayed_frames, replayed_chunks=s.replayed_chunks,
                            replay_max_diff=s.replay_max_diff, corr_id=int(s.corr_id or 0))


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
                             figsize=(max(6.0, mel.shape[1] / FRAMES_PER_SECOND), 0.4 + 2.8 * len(panels)))
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
