"""The solver's section of a snapshot (``s3flow.engine.snapshot``): a bounded-context stream's state, and back.

What a resume needs of a ``SequenceState`` beyond what its START carries again (the prompt, or the voice that
stands for it, and the options): the tokens still used as context and their offset, how many tokens came and
frames went out, the last emitted frames' mel (the next chunks' conditioning), and which frames' starting noise
is pinned. The pinned noise itself is not carried: every value of ``noised_mels`` is ``FrameNoise(seed)`` of its
frame (a chunk's starting point is carried noise or fresh noise, by induction from the first chunk), so its
range is enough. A digest of the kept prompt (its tokens and mel, and the speaker embedding) ties the section
to the START that must come with it. A stream that keeps its prompt's cache (``keep_solved`` 1) also carries the
tokens of the first chunk that made it, which the resumed stream solves again (``s3flow.engine.reuse``); a stream
whose prompt's cache came from a prompt pass (``s3flow.engine.voice_prompts``) says so, and the resumed stream
reads the same pass's cache, whether its START names the voice or carries the prompt.

Prefix mode has no snapshot (a chunk depends on every frame so far): its streams resume by replay.

Example::

    snapshots = SolverSnapshots(SnapshotKey(secret), solving, n_feats=80, meanflow=False)
    blob = snapshots.make(state)              # after a committed chunk: b"" when there is none to give
    snapshots.restore(fresh, blob)            # fresh: the resume START's new state; SnapshotError if refused
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from s3flow_contract.tensors import TOKEN_MEL_RATIO, VOCAB_SIZE
from s3flow.engine.settings import ChunkSolving
from s3flow.engine.snapshot import (SnapshotError, SnapshotKey, array_field, check_fields, digest, int_field, pack,
                                    unpack)
from s3flow.model.chunks import NoisedMels

KIND = "solver"
VERSION = 1


def prompt_digest(state) -> str:
    """The identity of what a stream was started with: the kept prompt's tokens and mel, the speaker embedding."""
    return digest(np.ascontiguousarray(state.prompt_tokens, np.int64).tobytes(),
                  np.ascontiguousarray(state.prompt_mel, np.float32).tobytes(),
                  np.ascontiguousarray(state.speaker_embedding, np.float32).tobytes())


class SolverSnapshots:
    """Makes and restores the solver's section with ``key`` (None: this server gives and takes none)."""

    def __init__(self, key: Optional[SnapshotKey], solving: ChunkSolving, n_feats: int, meanflow: bool):
        self.key, self.solving = key, solving
        self.settings = {"version": VERSION, "n_feats": int(n_feats), "meanflow": int(bool(meanflow)),
                         "context_frames": int(solving.context_frames), "prompt_frames": int(solving.prompt_frames),
                         "slide_prompt": int(solving.slide_prompt), "holdback_frames": int(solving.holdback_frames)}

    @property
    def enabled(self) -> bool:
        return self.key is not None and self.solving.context_frames >= 0

    def make(self, state) -> bytes:
        """The snapshot of ``state`` after a committed chunk (b"" in prefix mode or without a key)."""
        if not self.enabled:
            return b""
        noised = state.noised_mels
        fields = {**self.settings, "n_steps": int(state.n_steps), "guidance_rate": float(state.guidance_rate),
                  "seed": int(state.noise.seed), "prompt": prompt_digest(state),
                  "received_tokens": int(state.received_tokens), "token_offset": int(state.token_offset),
                  "emitted": int(state.emitted),
                  "noised_start": -1 if noised is None else int(noised.start),
                  "noised_stop": -1 if noised is None else int(noised.stop)}
        if state.prompt_pass:   # its prompt's cache is the prompt pass's: a resume makes the same
            fields["prompt_pass"] = 1
        arrays = {"tokens": np.asarray(state.tokens, np.int16)}   # ids < 6561
        if state.mel_tail is not None:
            arrays["mel_tail"] = np.asarray(state.mel_tail, np.float32)
        if self.solving.keep_solved == 1 and state.cache_tokens is not None:   # the chunk that made the cache
            arrays["cache_tokens"] = np.asarray(state.cache_tokens, np.int16)
        return self.key.seal(KIND, pack(fields, arrays), tenant=state.tenant)

    def restore(self, state, blob: bytes) -> None:
        """Bring ``state`` (new, from the resume's START: its prompt, options and tenant) to the snapshot's point;
        SnapshotError naming what is wrong, ``state`` then unchanged."""
        if self.solving.context_frames < 0:
            raise SnapshotError("this server streams in prefix mode (context_frames -1), which has no snapshots: "
                                "resume by replaying the utterance")
        if self.key is None:
            raise SnapshotError("this server holds no snapshot key (S3FLOW_SNAPSHOT_KEY_FILE): resume by replaying "
                                "the utterance")
        fields, arrays = unpack(self.key.open(blob, KIND, tenant=state.tenant))
        check_fields(fields, self.settings, "the solver's")
        check_fields(fields, {"n_steps": int(state.n_steps), "guidance_rate": float(state.guidance_rate),
                              "seed": int(state.noise.seed)}, "the solver's (options: send the START's own)")
        if fields.get("prompt") != prompt_digest(state):
            raise SnapshotError("the snapshot belongs to a stream started with another speaker prompt (or voice): "
                                "send the START's own")
        received = int_field(fields, "received_tokens", 1)
        offset = int_field(fields, "token_offset", 0, received)
        emitted = int_field(fields, "emitted", 0, TOKEN_MEL_RATIO * received)
        tokens = array_field(arrays, "tokens", "int16", (received - offset,)).astype(np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= VOCAB_SIZE):
            raise SnapshotError(f"snapshot tokens must be in [0, {VOCAB_SIZE})")
        tail = None
        if "mel_tail" in arrays:
            tail = array_field(arrays, "mel_tail", "float32", (state.prompt_mel.shape[0], -1))
            if tail.shape[1] > emitted:
                raise SnapshotError(f"snapshot mel_tail holds {tail.shape[1]} frames of {emitted} emitted")
        elif emitted:
            raise SnapshotError("snapshot has frames emitted but no mel_tail")
        lo = int_field(fields, "noised_start", -1, TOKEN_MEL_RATIO * received)
        hi = int_field(fields, "noised_stop", -1, TOKEN_MEL_RATIO * received)
        noised = None
        if lo >= 0:
            if hi < lo:
                raise SnapshotError(f"snapshot noised frames [{lo}, {hi}) are not a range")
            noised = NoisedMels(state.noise.frames(lo, hi), lo)
        cache_tokens = None
        if self.solving.keep_solved == 1 and "cache_tokens" in arrays:
            cache_tokens = array_field(arrays, "cache_tokens", "int16", (-1,)).astype(np.int64)
            if not 0 < cache_tokens.size <= received or cache_tokens.min() < 0 or cache_tokens.max() >= VOCAB_SIZE:
                raise SnapshotError(f"snapshot cache_tokens must be 1 to {received} tokens in [0, {VOCAB_SIZE})")
        state.received_tokens, state.token_offset, state.tokens = received, offset, tokens
        state.cache_tokens = cache_tokens
        state.prompt_pass = bool(int_field(fields, "prompt_pass", 0, 1)) if "prompt_pass" in fields else False
        state.emitted, state.mel_tail, state.noised_mels = emitted, None if tail is None else tail.copy(), noised
