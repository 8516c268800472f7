"""Per-utterance streaming state and the chunk engine that the Triton ``cfm_solver`` model runs.

Two modes (``Limits.context_frames``):

* **prefix** (``-1``): each chunk re-runs the encoder and the solver over the whole prefix (prompt + all
  tokens so far). A chunk's frames equal offline synthesis of the tokens so far; the cost of a stream
  grows with the square of its length.
* **bounded context** (``C >= 0``): each chunk's solve covers the speaker prompt, then the last C frames
  already emitted, used as conditioning exactly like the prompt (their mel in ``cond``, their tokens in the
  encoder input), then the new tokens. A chunk costs prompt + C + chunk frames, whatever the utterance's
  length.

In both, the ODE starting point of the frames made so far, ``noised_mels``, is carried from chunk to chunk
and pinned for the frames that are solved again (the lookahead and held-back frames, and in prefix mode
everything), with fresh seeded noise for new frames. Only frames that became final are returned, with their
frame offset. Every solve is built by ``s3flow.model.chunks``, as offline synthesis builds its own.

A chunk changes its sequence's state only once its solve has succeeded: a failed chunk leaves tokens,
``noised_mels`` and the emitted count as they were, so the client may send it again.

Several utterances' chunks that arrive together (Triton's ``oldest`` sequence batching) run as one
padded, masked batch per Euler step when they share step count and guidance rate.

The engine calls two functions it is given, so it runs in process (tests, benchmarks) or over BLS:

* ``encode(tokens (B, N) int64, token_len (B,) int64, embedding (B, 192) f32) -> (mu, mask, spks)``
* ``estimator(x, mask, mu, t, spks, cond, r=None) -> velocity`` (the solver's Estimator)
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from s3flow.contract import TOKEN_MEL_RATIO
from s3flow.model.chunks import Carried, condition, solve_frames, stack_rows, starting_point
from s3flow.protocol import ChunkRequest, Limits, RequestError, ServerBusy, parse_request
from s3flow.model.solver import FrameNoise, default_steps, solve_cfm

EncodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


@dataclass
class SequenceState:
    """Everything the server keeps for one utterance between its chunks."""
    prompt_tokens: np.ndarray          # (Np,) int64
    prompt_mel: np.ndarray             # (n_feats, Tp) float32
    speaker_embedding: np.ndarray      # (192,) float32
    n_steps: int
    guidance_rate: float
    noise: FrameNoise
    prompt_noise: np.ndarray           # (n_feats, Tp): the prompt region's fixed starting point
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # speech tokens so far
    noised_mels: Optional[Carried] = None  # ODE start of generated frames made (prefix mode: from 0)
    emitted: int = 0                   # generated frames already returned
    #: the last emitted frames, (n_feats, F) covering [emitted - F, emitted): bounded-context conditioning
    mel_tail: Optional[np.ndarray] = None
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def prompt_frames(self) -> int:
        return self.prompt_mel.shape[1]

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)


@dataclass
class Chunk:
    """An admitted request: its sequence's state (not yet changed by it), the new tokens, END."""
    corr_id: object
    state: SequenceState
    tokens: np.ndarray                 # (N,) int64
    finalize: bool
    new: bool                          # START: the state was created for this chunk
    replaced: Optional[SequenceState] = None  # the live state a START replaced (put back if it fails)


class SequenceStore:
    """States keyed by correlation id, with idle eviction and a cap on live sequences.

    Triton drops an idle sequence without telling the model, so ``evict_idle`` runs on every execute.
    """

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        self._states: OrderedDict[int, SequenceState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, corr_id) -> bool:
        return corr_id in self._states

    def create(self, corr_id, state: SequenceState):
        """Store a new sequence's state; returns the state it replaced (a START on a live id restarts
        that utterance), or None."""
        old = self._states.pop(corr_id, None)
        if len(self._states) >= self.limits.max_live_sequences:  # (never when it replaces one)
            wait = self.next_eviction_s()
            raise ServerBusy(f"too many live sequences ({len(self._states)}, max_live_sequences "
                             f"{self.limits.max_live_sequences}); retry in {wait:.1f} s", retry_after_s=wait)
        state.last_seen = self.clock()
        self._states[corr_id] = state
        return old

    def get(self, corr_id) -> SequenceState:
        state = self._states.get(corr_id)
        if state is None:
            raise RequestError(f"sequence {corr_id} is not active: it never started with a START request, "
                               f"already ended, or was evicted after {self.limits.idle_timeout_s} s idle")
        state.last_seen = self.clock()
        self._states.move_to_end(corr_id)
        return state

    def drop(self, corr_id) -> None:
        self._states.pop(corr_id, None)

    def put_back(self, corr_id, state: SequenceState) -> None:
        """Restore a state exactly as it was (a failed chunk's rollback)."""
        self._states[corr_id] = state

    def next_eviction_s(self) -> float:
        """Seconds until the least recently used state goes idle (the earliest a full store has room)."""
        if not self._states:
            return 0.0
        oldest = min(state.last_seen for state in self._states.values())
        return max(0.0, oldest + self.limits.idle_timeout_s - self.clock()) + 0.1

    def evict_idle(self) -> list:
        now, gone = self.clock(), []
        for corr_id, state in list(self._states.items()):
            if now - state.last_seen > self.limits.idle_timeout_s:
                gone.append(corr_id)
                del self._states[corr_id]
        return gone


@dataclass
class _Row:
    """One row of a solve, planned from a chunk without touching its state."""
    tokens: np.ndarray                 # (Nq,) encoder input: prompt ++ context tokens ++ the rest
    prefix_mel: np.ndarray             # (n_feats, P): prompt mel ++ context mel
    start: np.ndarray                  # (n_feats, P + g - c0): the ODE starting point
    c0: int                            # first generated frame in the solve (0 in prefix mode)
    g: int                             # generated frames valid after this chunk
    ready: int                         # generated frames final after this chunk

    @property
    def frames(self) -> int:
        return self.start.shape[1]


class StreamingEngine:
    """Turns a batch of validated chunk requests into newly final mel frames."""

    def __init__(self, encode: EncodeFn, estimator, *, n_feats: int, meanflow: bool, limits: Limits,
                 store: Optional[SequenceStore] = None, bucket_ratio: float = 0.0):
        if bucket_ratio and bucket_ratio < 1:
            raise ValueError(f"bucket_ratio must be 0 (off) or >= 1, got {bucket_ratio}")
        self.bucket_ratio = float(bucket_ratio)
        self.encode, self.estimator = encode, estimator
        self.n_feats, self.meanflow, self.limits = n_feats, meanflow, limits
        self.store = store or SequenceStore(limits)
        #: None: prefix mode; C >= 0: bounded context of C emitted frames
        self.context_frames = None if limits.context_frames < 0 else int(limits.context_frames)
        self.estimator_calls = 0
        self.solved_frames = 0           # sum over solves of rows' frames x Euler steps (cost figures)

    # -- admission -------------------------------------------------------------------------------
    def admit(self, corr_id, req: ChunkRequest) -> Chunk:
        """Create (START) or fetch the sequence's state and check the chunk against the limits. The
        state's tokens are not changed here: ``run`` applies the chunk once its solve has succeeded."""
        if req.start:
            steps = req.n_timesteps or self.limits.default_steps or default_steps(self.meanflow)
            rate = self.limits.default_guidance_rate if req.guidance_rate is None else req.guidance_rate
            noise = FrameNoise(req.seed, self.n_feats)
            state = SequenceState(prompt_tokens=req.prompt_tokens, prompt_mel=req.prompt_mel,
                                  speaker_embedding=req.speaker_embedding, n_steps=int(steps),
                                  guidance_rate=0.0 if self.meanflow else float(rate), noise=noise,
                                  prompt_noise=noise.prompt(req.prompt_mel.shape[1]))
            replaced = self.store.create(corr_id, state)
        else:
            state, replaced = self.store.get(corr_id), None
        frames = TOKEN_MEL_RATIO * (state.n_tokens + req.speech_tokens.size)
        if frames > self.limits.max_utterance_frames:
            self.store.drop(corr_id)
            raise RequestError(f"utterance grows to {frames} frames, above max_utterance_frames "
                               f"{self.limits.max_utterance_frames}; the sequence is ended")
        return Chunk(corr_id, state, req.speech_tokens, finalize=req.end, new=req.start, replaced=replaced)

    # -- one step for several sequences --------------------------------------------------------------
    def run(self, chunks: list[Chunk], on_step: Optional[Callable[[int], None]] = None) -> list["ChunkResult"]:
        """Advance each chunk's sequence by its tokens; same order out.

        Chunks are grouped by (steps, guidance rate); each group is one padded batch, or, with
        ``bucket_ratio`` r >= 1 (length bucketing), several: rows sorted by frames, a new batch begun where
        a row is more than r times as long as the batch's shortest, so short rows do not pay for the
        padding of long ones. States change only after every solve has succeeded; on an exception the
        sequences are as before (a START's new state is dropped, a state it replaced put back) and the
        exception propagates.
        """
        solved: list[Optional[np.ndarray]] = [None] * len(chunks)
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(chunks):
            groups.setdefault((c.state.n_steps, c.state.guidance_rate), []).append(i)
        try:
            rows = [self._plan(c) for c in chunks]
            for (steps, rate), idx in groups.items():
                for part in self._buckets(rows, idx):
                    xs = self._solve([chunks[i] for i in part], [rows[i] for i in part], steps, rate, on_step)
                    for i, x in zip(part, xs):
                        solved[i] = x
        except BaseException:
            for c in chunks:
                if c.new:
                    self.store.drop(c.corr_id)
                    if c.replaced is not None:
                        self.store.put_back(c.corr_id, c.replaced)
            raise
        return [self._commit(c, row, x) for c, row, x in zip(chunks, rows, solved)]

    def _plan(self, c: Chunk) -> _Row:
        s = c.state
        e = s.emitted
        context = np.zeros((self.n_feats, 0), np.float32)
        if self.context_frames is None:  # prefix mode: everything is solved again, the prompt alone conditions
            c0 = 0
        else:
            c0 = max(0, e - self.context_frames)
            c0 -= c0 % TOKEN_MEL_RATIO  # a whole number of tokens
            if e > c0:
                context = s.mel_tail[:, s.mel_tail.shape[1] - (e - c0):]
        tokens = np.concatenate([s.prompt_tokens, s.tokens[c0 // TOKEN_MEL_RATIO:], c.tokens])
        prefix_mel = np.concatenate([s.prompt_mel, context], axis=1)
        length = int(solve_frames(torch.tensor([tokens.size]), prefix_mel.shape[1], c.finalize)[0])
        g = c0 + length - s.prompt_frames
        ready = g if c.finalize else max(g - self.limits.holdback_frames, e)
        start = starting_point(s.noise, s.prompt_noise, c0, g, s.noised_mels)
        return _Row(tokens, prefix_mel, start, c0, g, ready)

    def _buckets(self, rows: list[_Row], idx: list[int]) -> list[list[int]]:
        if not self.bucket_ratio or len(idx) < 2:
            return [idx]
        order = sorted(idx, key=lambda i: rows[i].frames)
        parts, shortest = [], None
        for i in order:
            if shortest is None or rows[i].frames > self.bucket_ratio * shortest:
                parts.append([])
                shortest = rows[i].frames
            parts[-1].append(i)
        return parts

    def _solve(self, chunks: list[Chunk], rows: list[_Row], steps: int, rate: float, on_step) -> list[np.ndarray]:
        """One padded batch: encoder, condition, Euler solve; per row the solved (n_feats, frames)."""
        b = len(rows)
        token_len = torch.tensor([r.tokens.size for r in rows], dtype=torch.int64)
        tokens = torch.zeros(b, int(token_len.max()), dtype=torch.int64)
        for i, r in enumerate(rows):
            tokens[i, :r.tokens.size] = torch.from_numpy(r.tokens)
        emb = torch.from_numpy(np.stack([c.state.speaker_embedding for c in chunks]))
        mu, _, spks = self.encode(tokens, token_len, emb)
        lengths = torch.tensor([r.frames for r in rows], dtype=torch.int64)
        cond = condition(mu.float(), spks.float(), lengths, [torch.from_numpy(r.prefix_mel) for r in rows])
        dev = mu.device  # GPU hosts: the encoder's output is on the GPU; the solve stays there
        z = stack_rows([r.start for r in rows], cond.mu.shape[2]).to(dev)  # filled on the host, moved once
        x = solve_cfm(self.estimator, z, cond.mu, cond.mask, cond.spks, cond.cond, meanflow=self.meanflow,
                      n_steps=steps, guidance_rate=rate, on_step=on_step).x.float().cpu()
        self.estimator_calls += steps
        self.solved_frames += steps * int(lengths.max()) * b
        return [x[i, :, :r.frames].numpy() for i, r in enumerate(rows)]

    def _commit(self, c: Chunk, row: _Row, x: np.ndarray) -> "ChunkResult":
        """Apply a solved chunk to its sequence's state; the newly final frames."""
        s = c.state
        tp, e = s.prompt_frames, s.emitted  # generated frame f sits at tp + f - c0 in the solve
        mel = x[:, tp + e - row.c0:tp + row.ready - row.c0].copy()
        if c.tokens.size:
            s.tokens = np.concatenate([s.tokens, c.tokens])
        keep_from = 0
        if self.context_frames is not None:  # what a later chunk can still need: its context and on
            keep_from = max(0, row.ready - self.context_frames - TOKEN_MEL_RATIO)
            tail = mel.copy() if s.mel_tail is None else np.concatenate([s.mel_tail, mel], axis=1)
            s.mel_tail = tail[:, max(0, tail.shape[1] - (row.ready - keep_from)):]
        keep_from = max(keep_from, row.c0)
        s.noised_mels = Carried(row.start[:, tp + keep_from - row.c0:], keep_from) if row.g > keep_from else None
        s.emitted = row.ready
        if c.finalize:
            self.store.drop(c.corr_id)
        else:
            s.last_seen = self.store.clock()  # idle time counts from the answer, not the request
        return ChunkResult(mel=mel, frame_offset=e)


@dataclass
class ChunkResult:
    """mel: (n_feats, F) the newly final frames; frame_offset: index of the first of them."""
    mel: np.ndarray
    frame_offset: int


def planned_calls(n_feats: int, prompt_tokens: int, chunks: Sequence[int], context_frames: int, steps: int,
                  meanflow: bool = False) -> list[tuple[int, int]]:
    """The (batch rows, frames) of every estimator call of one utterance streamed in ``chunks`` (guided unless
    ``meanflow``), planned by the real ``StreamingEngine`` over stand-in models (zeros): the cost of any model
    size without running it."""
    calls: list[tuple[int, int]] = []

    def encode(tokens, token_len, embedding):
        t = 2 * tokens.shape[1]
        return torch.zeros(tokens.shape[0], n_feats, t), None, torch.zeros(tokens.shape[0], n_feats)

    def estimate(x, mask, mu, t, spks, cond, r=None):
        calls.append((x.shape[0], x.shape[2]))
        return torch.zeros_like(x)

    limits = Limits(context_frames=context_frames, max_utterance_frames=max(3000, 2 * sum(chunks)),
                    max_chunk_tokens=max(chunks))
    engine = StreamingEngine(encode, estimate, n_feats=n_feats, meanflow=meanflow, limits=limits)
    rng = np.random.default_rng(0)
    for k, size in enumerate(chunks):
        inputs = {"speech_tokens": rng.integers(0, 6561, (1, size), dtype=np.int64)}
        if k == 0:
            inputs.update(prompt_tokens=rng.integers(0, 6561, (1, prompt_tokens), dtype=np.int64),
                          prompt_mel=np.zeros((1, 2 * prompt_tokens, n_feats), np.float32),
                          speaker_embedding=np.ones((1, 192), np.float32), n_timesteps=np.array([[steps]], np.int32),
                          guidance_rate=np.array([[0.7]], np.float32))
        req = parse_request(inputs, start=k == 0, end=k == len(chunks) - 1, limits=limits, n_feats=n_feats)
        engine.run([engine.admit(1, req)])
    return calls
