"""Per-utterance streaming state and the chunk engine that the Triton ``cfm_solver`` model runs.

Each chunk re-runs the encoder and the solver over the whole prefix (prompt + all tokens so far). The
ODE starting point of the frames made so far, ``noised_mels``, is carried from chunk to chunk and pinned,
with fresh seeded noise for new frames, so that the re-integrated prefix starts where it started before.
Only frames that became final are returned, with their frame offset.

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
from typing import Callable, Optional

import numpy as np
import torch

from .flow import PRE_LOOKAHEAD_TOKENS, TOKEN_MEL_RATIO
from .protocol import ChunkRequest, Limits, RequestError
from .solver import FrameNoise, default_steps, make_field, euler_solve, time_grid

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
    tokens: list = field(default_factory=list)   # speech-token chunks so far
    n_tokens: int = 0
    noised_mels: Optional[np.ndarray] = None      # (n_feats, G): ODE start of the generated frames made
    emitted: int = 0                   # generated frames already returned
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def prompt_frames(self) -> int:
        return self.prompt_mel.shape[1]


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

    def create(self, corr_id, state: SequenceState) -> None:
        self._states.pop(corr_id, None)  # a START on a live id restarts that utterance
        if len(self._states) >= self.limits.max_live_sequences:
            raise RequestError(f"too many live sequences ({len(self._states)}, max_live_sequences "
                               f"{self.limits.max_live_sequences}); retry later")
        state.last_seen = self.clock()
        self._states[corr_id] = state

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

    def evict_idle(self) -> list:
        now, gone = self.clock(), []
        for corr_id, state in list(self._states.items()):
            if now - state.last_seen > self.limits.idle_timeout_s:
                gone.append(corr_id)
                del self._states[corr_id]
        return gone


@dataclass
class ChunkResult:
    """mel: (n_feats, F) the newly final frames; frame_offset: index of the first of them."""
    mel: np.ndarray
    frame_offset: int


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
        self.lookahead_frames = PRE_LOOKAHEAD_TOKENS * TOKEN_MEL_RATIO
        self.estimator_calls = 0

    # -- admission -------------------------------------------------------------------------------
    def admit(self, corr_id, req: ChunkRequest) -> SequenceState:
        """Create or fetch the sequence's state and append the chunk's tokens (validates limits)."""
        if req.start:
            steps = req.n_timesteps or self.limits.default_steps or default_steps(self.meanflow)
            rate = self.limits.default_guidance_rate if req.guidance_rate is None else req.guidance_rate
            noise = FrameNoise(req.seed, self.n_feats)
            state = SequenceState(prompt_tokens=req.prompt_tokens, prompt_mel=req.prompt_mel,
                                  speaker_embedding=req.speaker_embedding, n_steps=int(steps),
                                  guidance_rate=0.0 if self.meanflow else float(rate), noise=noise,
                                  prompt_noise=noise.prompt(req.prompt_mel.shape[1]))
            self.store.create(corr_id, state)
        else:
            state = self.store.get(corr_id)
        frames = TOKEN_MEL_RATIO * (state.n_tokens + req.speech_tokens.size)
        if frames > self.limits.max_utterance_frames:
            self.store.drop(corr_id)
            raise RequestError(f"utterance grows to {frames} frames, above max_utterance_frames "
                               f"{self.limits.max_utterance_frames}; the sequence is ended")
        if req.speech_tokens.size:
            state.tokens.append(req.speech_tokens)
            state.n_tokens += req.speech_tokens.size
        return state

    # -- one step for several sequences --------------------------------------------------------------
    def run(self, items: list[tuple[object, SequenceState, bool]],
            on_step: Optional[Callable[[int], None]] = None) -> list[ChunkResult]:
        """Advance each (corr_id, state, finalize) by its newest chunk; same order out.

        Items are grouped by (steps, guidance rate); each group is one padded batch, or, with
        ``bucket_ratio`` r >= 1 (length bucketing), several: rows sorted by frames, a new batch begun where
        a row is more than r times as long as the batch's shortest, so short prefixes do not pay for the
        padding of long ones.
        """
        results: list[Optional[ChunkResult]] = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for i, (_, state, _) in enumerate(items):
            groups.setdefault((state.n_steps, state.guidance_rate), []).append(i)
        for (steps, rate), idx in groups.items():
            for part in self._buckets(items, idx):
                outs = self._run_group([items[i] for i in part], steps, rate, on_step)
                for i, out in zip(part, outs):
                    results[i] = out
        for corr_id, state, finalize in items:
            if finalize:
                self.store.drop(corr_id)
            else:
                state.last_seen = self.store.clock()  # idle time counts from the answer, not the request
        return results

    def _frames(self, state: SequenceState, finalize: bool) -> int:
        """Estimator frames of the state's next solve (prompt + tokens so far, less the lookahead)."""
        frames = TOKEN_MEL_RATIO * (len(state.prompt_tokens) + state.n_tokens)
        return frames if finalize else max(frames - self.lookahead_frames, state.prompt_frames)

    def _buckets(self, items, idx: list[int]) -> list[list[int]]:
        if not self.bucket_ratio or len(idx) < 2:
            return [idx]
        order = sorted(idx, key=lambda i: self._frames(items[i][1], items[i][2]))
        parts, shortest = [], None
        for i in order:
            frames = self._frames(items[i][1], items[i][2])
            if shortest is None or frames > self.bucket_ratio * shortest:
                parts.append([])
                shortest = frames
            parts[-1].append(i)
        return parts

    def _run_group(self, items, steps: int, rate: float, on_step) -> list[ChunkResult]:
        b, c = len(items), self.n_feats
        states = [s for _, s, _ in items]
        finals = [f for _, _, f in items]
        # encoder over prompt + all tokens so far, one padded batch
        seqs = [np.concatenate([s.prompt_tokens] + s.tokens) for s in states]
        token_len = torch.tensor([len(q) for q in seqs], dtype=torch.int64)
        tokens = torch.zeros(b, int(token_len.max()), dtype=torch.int64)
        for i, q in enumerate(seqs):
            tokens[i, :len(q)] = torch.from_numpy(q)
        emb = torch.from_numpy(np.stack([s.speaker_embedding for s in states]))
        mu_full, _, spks = self.encode(tokens, token_len, emb)

        # per-row lengths: drop the lookahead frames unless finalised; build mask, cond and noise
        prompt = torch.tensor([s.prompt_frames for s in states], dtype=torch.int64)
        lengths = token_len * TOKEN_MEL_RATIO
        not_final = torch.tensor([not f for f in finals])
        lengths = torch.where(not_final, (lengths - self.lookahead_frames).clamp(min=prompt), lengths)
        t = int(lengths.max())
        dev = mu_full.device  # GPU hosts: the encoder's output is on the GPU; the solve stays there
        mask = (torch.arange(t)[None, :] < lengths[:, None]).float()[:, None, :].to(dev)
        mu = mu_full[:, :, :t].float() * mask
        cond = torch.zeros(b, c, t)
        z = torch.zeros(b, c, t)
        generated = (lengths - prompt).tolist()
        for i, s in enumerate(states):
            tp, g = s.prompt_frames, generated[i]
            cond[i, :, :tp] = torch.from_numpy(s.prompt_mel)
            have = 0 if s.noised_mels is None else s.noised_mels.shape[1]
            fresh = s.noise.frames(have, g) if g > have else np.zeros((c, 0), np.float32)
            start = s.noised_mels[:, :g] if have else np.zeros((c, 0), np.float32)
            s.noised_mels = np.concatenate([start, fresh], axis=1)
            z[i, :, :tp] = torch.from_numpy(s.prompt_noise)
            z[i, :, tp:tp + g] = torch.from_numpy(s.noised_mels)

        cond, z = cond.to(dev), z.to(dev)  # filled on the host row by row, moved once
        grid = time_grid(steps, "linear" if self.meanflow else "cosine", device=dev)
        field_ = make_field(self.estimator, mu, mask, spks.float(), cond, meanflow=self.meanflow,
                            guidance_rate=rate)
        x = euler_solve(field_, z, grid, on_step=on_step).x.float().cpu()  # one copy back per chunk
        self.estimator_calls += steps

        out = []
        for i, s in enumerate(states):
            tp, g = s.prompt_frames, generated[i]
            ready = g if finals[i] else max(g - self.limits.holdback_frames, s.emitted)
            mel = x[i, :, tp + s.emitted:tp + ready].numpy().copy()
            out.append(ChunkResult(mel=mel, frame_offset=s.emitted))
            s.emitted = ready
        return out
