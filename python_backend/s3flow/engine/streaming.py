"""Per-utterance streaming state and the chunk engine that the Triton ``cfm_solver`` model runs.

Two modes (``ChunkSolving.context_frames``, ``s3flow.engine.settings``):

* **prefix** (``-1``): each chunk re-runs the encoder and the solver over the whole prefix (prompt + all
  tokens so far). A chunk's frames equal offline synthesis of the tokens so far; the cost of a stream
  grows with the square of its length.
* **bounded context** (``C >= 0``): each chunk's solve covers the speaker prompt, then the last C frames
  already emitted, used as conditioning exactly like the prompt (their mel in ``cond``, their tokens in the
  encoder input), then the new tokens. A chunk costs prompt + C + chunk frames, and the state keeps only
  those C frames' mel and tokens (and the frames not yet final), whatever the utterance's length: a stream
  may go on for hours (no length cap; the prefix mode keeps ``max_utterance_frames``).

The speaker prompt conditions a chunk in one of three ways (``ChunkSolving.prompt_frames``,
``slide_prompt``): whole (the default); capped to its last P frames, kept on every chunk; or, in bounded
context, sliding: the conditioning is the last C frames of prompt ++ emitted mel, so the emitted frames (the
same voice) push the prompt out and a chunk's cost no longer depends on the prompt's length at all. In every
case a chunk equals offline synthesis with its stated conditioning as the prompt, from the same frame noise.

In both, the ODE starting point of the frames made so far, ``noised_mels``, is carried from chunk to chunk
and pinned for the frames that are solved again (the lookahead and held-back frames, and in prefix mode
everything), with fresh seeded noise for new frames. Only frames that became final are returned, with their
frame offset. Every solve is built by ``s3flow.model.chunks``, as offline synthesis builds its own.

With ``ChunkSolving.keep_solved`` 1 or 2 (bounded context, the prompt not sliding), a stream keeps what the
estimator reads of its prompt (and of its last C emitted frames) from the chunk that solved them, and a later chunk
solves only its context and new frames (or only its new ones): ``s3flow.engine.reuse``.

A chunk changes its sequence's state only once its solve has succeeded: a failed chunk leaves tokens,
``noised_mels`` and the emitted count as they were, so the client may send it again. A chunk that says where it
starts (``token_offset``) is never applied twice: the chunk a sequence took last, sent again (its answer was lost,
or a later model failed on it), is answered again from the state's copy of that answer; an older one or one
leaving a gap is refused. In bounded context each committed chunk's answer carries the stream's **snapshot**
(``s3flow.engine.solver_snapshot``), and a START that brings one back goes on from it (a resume costs one
chunk). The sequences' lifetimes
(begin, serve, commit, roll back, end, idle eviction, the cap on live sequences) are the
``SequenceTable``'s (``s3flow.engine.sequences``); what the engine does is reported to an ``Observer``
(``s3flow.engine.observer``: estimator steps with their batch, answered chunks, dropped sequences).

A request takes three shapes on its way in: the tensors, a validated ``ChunkRequest``
(``s3flow.protocol``), and an admitted ``Chunk``: the sequence's state with the chunk's planned solve.

Several utterances' chunks that arrive together (Triton's ``oldest`` sequence batching) run as one padded,
masked batch per Euler step, whatever their step counts and guidance rates (``run``: the one solving loop,
``s3flow.engine.step_loop``, under its ``whole`` policy; the deadline scheduling runs the same loop step by step).

The engine calls two functions it is given, so it runs in process (tests, benchmarks) or over BLS:

* ``encode(tokens (B, N) int64, token_len (B,) int64, embedding (B, 192) f32) -> (mu, mask, spks)``
* ``estimator(inputs: EstimatorInputs) -> velocity`` (the solver's ``Estimator``)
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import numpy as np
import torch

from s3flow_contract.tensors import TOKEN_MEL_RATIO
from s3flow.engine.capacity import Work
from s3flow.engine.chunk import Answered, Chunk, ChunkResult, SequenceState
from s3flow.engine.observer import NO_OBSERVER, Observer
from s3flow.engine.sequences import SequenceLimits, SequenceTable
from s3flow.engine.settings import ChunkSolving
from s3flow.engine.scheduler import check_bucket_ratio
from s3flow.engine.solver_snapshot import SolverSnapshots, prompt_digest
from s3flow.engine.step_loop import Flight, StepLoop, never_cancelled
from s3flow.engine.reuse import REUSE_MODES, StreamCache
from s3flow.engine.stepping import RowSolve, StepCaches
from s3flow.engine.voice_prompts import PROMPT_PASS_SEED, VoicePrompts
from s3flow.model.chunks import NoisedMels, condition, solve_frames, starting_point
from s3flow.model.solver import FrameNoise, cfm_grid, default_steps
from s3flow.protocol import ChunkRequest, RequestError

EncodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


class StreamingEngine:
    """Turns a batch of validated chunk requests into newly final mel frames."""

    def __init__(self, encode: EncodeFn, estimator, *, n_feats: int, meanflow: bool,
                 solving: ChunkSolving = ChunkSolving(), limits: SequenceLimits = SequenceLimits(),
                 observer: Observer = NO_OBSERVER, bucket_ratio: float = 0.0,
                 table: Optional[SequenceTable] = None, snapshots: Optional[SolverSnapshots] = None,
                 timer: Callable[[], float] = time.perf_counter):
        """``snapshots``: makes and restores the streams' snapshots (default: none given or taken); ``timer``: what
        the network calls reported to the observer are timed by (the simulator's: its virtual clock)."""
        check_bucket_ratio(bucket_ratio)
        self.bucket_ratio = float(bucket_ratio)
        self.encode, self.estimator = encode, estimator
        self.n_feats, self.meanflow, self.solving = n_feats, meanflow, solving
        self.observer = observer
        self.sequences: SequenceTable[SequenceState] = (table if table is not None
                                                      else SequenceTable(limits, observer))
        #: None: prefix mode; C >= 0: bounded context of C emitted frames
        self.context_frames = None if solving.context_frames < 0 else int(solving.context_frames)
        #: what a stream keeps of its solved frames (``s3flow.engine.reuse``)
        self.reuse = REUSE_MODES[solving.keep_solved]
        if self.reuse != "none" and not getattr(estimator, "carries_prefix", False):
            raise ValueError(f"keep_solved {solving.keep_solved} needs an estimator that takes a prefix cache "
                             f"(carries_prefix)")
        #: the prompt caches registered voices hold (``s3flow.engine.voice_prompts``; None: voice_cache_mb 0)
        self.voice_prompts = (VoicePrompts(solving.voice_cache_mb << 20)
                              if self.reuse != "none" and solving.voice_cache_mb else None)
        self.estimator_calls = 0
        self.solved_frames = 0           # sum over solves of rows' frames x Euler steps (cost figures)
        self.prompt_pass_frames = 0      # ... of them, the voices' prompt passes'
        self.snapshots = snapshots or SolverSnapshots(None, solving, n_feats, meanflow)
        #: the loop a batch of chunks is solved whole in (``run``; the ``fifo`` scheduling's)
        self.timer = timer
        self.whole = StepLoop(self, policy="whole", bucket_ratio=self.bucket_ratio, timer=timer)

    # -- admission -------------------------------------------------------------------------------
    def admit(self, corr_id, req: ChunkRequest, tenant: str = "") -> Chunk | ChunkResult:
        """Begin (START, from a snapshot when it brings one) or serve the sequence and plan the chunk's solve; or,
        for the chunk the sequence took last sent again, its answer again (the sequence as it was). The state is
        not changed here: ``run`` applies the chunk once its solve has succeeded (or rolls the admission back)."""
        if req.start:
            state = self._new_state(req, tenant)
            replaced = self.sequences.begin(corr_id, state)
        else:
            state, replaced = self.sequences.serve(corr_id), None
            try:
                again = self._taken_before(state, req)
            except BaseException:
                self.sequences.rollback(corr_id, None, started=False)
                raise
            if again is not None:
                self.sequences.commit(corr_id, end=False)
                return again
        frames = TOKEN_MEL_RATIO * (state.received_tokens + req.speech_tokens.size)
        if self.context_frames is None and frames > self.solving.max_utterance_frames:  # prefix mode only
            self.sequences.end(corr_id, "utterance too long")
            raise RequestError(f"utterance grows to {frames} frames, above max_utterance_frames "
                               f"{self.solving.max_utterance_frames} (the prefix re-run mode's cap; bounded-context "
                               f"streams have none); the sequence is ended")
        try:
            return self._plan(corr_id, state, req, replaced)
        except BaseException:   # nothing admitted may stay in flight
            self.sequences.rollback(corr_id, replaced, started=req.start)
            raise

    def _new_state(self, req: ChunkRequest, tenant: str) -> SequenceState:
        """A START's state: from its prompt and options, then, for a resume, the snapshot's point."""
        steps = req.n_timesteps or self.solving.default_steps or default_steps(self.meanflow)
        rate = self.solving.default_guidance_rate if req.guidance_rate is None else req.guidance_rate
        noise = FrameNoise(req.seed, self.n_feats)
        tp = req.prompt_mel.shape[1]
        cut = tp - self._prompt_kept(tp)   # frames before the kept tail never condition anything
        state = SequenceState(prompt_tokens=req.prompt_tokens[cut // TOKEN_MEL_RATIO:],
                              prompt_mel=req.prompt_mel[:, cut:],
                              speaker_embedding=req.speaker_embedding, n_steps=int(steps),
                              guidance_rate=0.0 if self.meanflow else float(rate), noise=noise,
                              prompt_noise=noise.prompt(tp)[:, cut:], tenant=tenant,
                              prompt_pass=req.voice is not None and self.voice_prompts is not None)
        if req.resume is not None:
            self.snapshots.restore(state, req.resume)
            if req.token_offset is not None and req.token_offset != state.received_tokens:
                raise RequestError(f"token_offset {req.token_offset} of a resume START must be the "
                                   f"{state.received_tokens} tokens its snapshot covers")
        return state

    @staticmethod
    def _taken_before(state: SequenceState, req: ChunkRequest) -> Optional[ChunkResult]:
        """The answer again if ``req`` is the chunk ``state`` took last; RequestError for an older chunk or a gap;
        None for the next chunk (or one that does not say where it starts)."""
        if req.token_offset is None or req.token_offset == state.received_tokens:
            return None
        if state.last is not None and state.last.is_again(req):
            return state.last.result
        if req.token_offset < state.received_tokens:
            raise RequestError(f"the chunk at token_offset {req.token_offset} ({req.speech_tokens.size} tokens) was "
                               f"applied already: the sequence has taken {state.received_tokens} tokens (only the "
                               f"chunk taken last is answered again, sent as it was)")
        raise RequestError(f"token_offset {req.token_offset} leaves a gap: the sequence has taken "
                           f"{state.received_tokens} tokens")

    def _prompt_kept(self, prompt_frames: int) -> int:
        """Frames of a prompt of ``prompt_frames`` that the state keeps: all, or the capped tail (whole tokens)."""
        cap = self.solving.prompt_frames
        return prompt_frames if cap < 0 else min(prompt_frames, cap - cap % TOKEN_MEL_RATIO)

    def _plan(self, corr_id, s: SequenceState, req: ChunkRequest, replaced: Optional[SequenceState]) -> Chunk:
        e = s.emitted
        context = np.zeros((self.n_feats, 0), np.float32)
        if self.context_frames is None:  # prefix mode: everything is solved again, the prompt alone conditions
            first = 0
        else:
            first = max(0, e - self.context_frames)
            first -= first % TOKEN_MEL_RATIO  # a whole number of tokens
            if e > first:
                context = s.mel_tail[:, s.mel_tail.shape[1] - (e - first):]
        used = s.prompt_frames
        if self.solving.slide_prompt:   # the window of C frames over prompt ++ emitted: the prompt fills the rest
            room = max(0, self.context_frames - context.shape[1])
            used = min(used, room - room % TOKEN_MEL_RATIO)
        tokens = np.concatenate([s.prompt_tokens[s.prompt_tokens.size - used // TOKEN_MEL_RATIO:],
                                 s.tokens[first // TOKEN_MEL_RATIO - s.token_offset:], req.speech_tokens])
        prefix_mel = np.concatenate([s.prompt_mel[:, s.prompt_frames - used:], context], axis=1)
        length = int(solve_frames(torch.tensor([tokens.size]), prefix_mel.shape[1], req.end)[0])
        valid = first + length - used
        final = valid if req.end else max(valid - self.solving.holdback_frames, e)
        start = starting_point(s.noise, s.prompt_noise[:, s.prompt_frames - used:], first, valid, s.noised_mels)
        if req.chunk_steps is not None and req.chunk_steps > s.n_steps:
            raise RequestError(f"chunk_steps {req.chunk_steps} is above the stream's n_timesteps {s.n_steps} (a "
                               f"replay sends the steps its answer said)")
        chunk = Chunk(corr_id, s, req.speech_tokens, finalize=req.end, started=req.start, replaced=replaced,
                      encoder_tokens=tokens, prefix_mel=prefix_mel, prompt_frames=used, start=start,
                      first_frame=first, valid_frames=valid, final_frames=final,
                      steps=req.chunk_steps or s.n_steps, pinned=req.chunk_steps is not None)
        if self.reuse != "none":
            # the voice's prompt cache, where the stream has none of this grid (a chunk at other steps solved its
            # prompt inline); with context kept only at the start (the voice's cache holds no context)
            stale = s.cache is None or s.cache.steps != chunk.steps
            if s.prompt_pass and used > 0 and chunk.steps == s.n_steps and (
                    stale if self.reuse == "prompt" else s.cache is None and e == 0):
                s.cache = self._held_prompt(s)
                if s.cache is None:   # the voice's prompt pass, solved before this chunk
                    chunk.replay = self._prompt_pass(corr_id, s)
            self._reuse(chunk)
            if s.cache is None and chunk.replay is None and s.cache_tokens is not None and chunk.steps == s.n_steps:
                # a resumed stream whose first chunk made its prompt cache: that chunk again, first
                chunk.replay = self._plan(corr_id, s.started(), dataclasses.replace(
                    req, speech_tokens=s.cache_tokens, start=True, end=False, token_offset=None, chunk_steps=None,
                    resume=None), None)
        return chunk

    def _prompt_key(self, s: SequenceState) -> tuple:
        return s.tenant, prompt_digest(s), s.n_steps, s.guidance_rate

    def _held_prompt(self, s: SequenceState) -> Optional[StreamCache]:
        return None if self.voice_prompts is None else self.voice_prompts.get(self._prompt_key(s))

    def _prompt_pass(self, corr_id, s: SequenceState) -> Chunk:
        """The solve that makes ``s``'s prompt cache from its prompt alone (``s3flow.engine.voice_prompts``): the
        capped prompt's tokens encoded alone, its frames from ``FrameNoise(PROMPT_PASS_SEED)``, at the stream's
        steps and guidance, every frame kept; nothing answered, nothing committed (``StepLoop._replay``)."""
        tp = s.prompt_frames
        return Chunk(corr_id, s, np.zeros(0, np.int64), finalize=False, started=False, replaced=None,
                     encoder_tokens=s.prompt_tokens, prefix_mel=s.prompt_mel, prompt_frames=tp,
                     start=FrameNoise(PROMPT_PASS_SEED, self.n_feats).prompt(tp), first_frame=0, valid_frames=0,
                     final_frames=0, steps=s.n_steps, keep=tp)

    def _reuse(self, c: Chunk) -> None:
        """Which of ``c``'s leading frames it reads from its stream's cache, and which it keeps."""
        s, context = c.state, self.reuse == "context"
        cache = s.cache
        e = s.emitted
        if cache is not None and cache.steps == c.steps and cache.prompt == c.prompt_frames:
            c.past = cache.caches
            c.skipped = c.prompt_frames + (e - c.first_frame if context else 0)
            c.keep = c.final_frames - e if context else 0
        else:   # solved inline: keep the prompt (and the emitted frames)
            c.keep = c.prompt_frames + (c.final_frames - c.first_frame if context else 0)
        if c.finalize:   # the stream ends with this chunk: nothing to keep (one request keeps nothing)
            c.keep = 0

    # -- a batch of chunks, solved whole -------------------------------------------------------------
    def run(self, chunks: list[Chunk], is_cancelled: Callable[[], bool] = never_cancelled) -> list[ChunkResult]:
        """Advance each chunk's sequence by its tokens; same order out: the solver's one loop
        (``s3flow.engine.step_loop``) under the ``whole`` policy, every chunk in every step (with ``bucket_ratio``
        r >= 1, length bucketing: the bucket of the shortest first, so short rows do not pay for the padding of
        long ones). Each chunk's state changes once its own solve has succeeded; a failed one is rolled back
        (``SequenceTable.rollback``: a START's new state goes, a state it replaced comes back, a later chunk's state
        is as before) and, after the others are answered, the first failure's cause is raised
        (``SolverSession`` maps each chunk's outcome instead: ``solve``)."""
        done = self.solve(chunks, is_cancelled)
        failed = [d.cause for d in done if d.cause is not None]
        if failed:
            raise failed[0]
        return [d.result for d in done]

    def solve(self, chunks: list[Chunk], is_cancelled: Callable[[], bool] = never_cancelled) -> list[Flight]:
        """:meth:`run`'s outcomes, one per chunk (its ``s3flow.engine.step_loop.Flight``, answered), nothing
        raised."""
        return self.whole.solve(chunks, is_cancelled)

    def prepare(self, chunks: list[Chunk]) -> list[RowSolve]:
        """The chunks' encoder call (one padded batch) and conditioning: one ``RowSolve`` per chunk, at step 0
        of its own grid, on the encoder's device (``s3flow.engine.stepping``)."""
        b = len(chunks)
        token_len = torch.tensor([c.encoder_tokens.size for c in chunks], dtype=torch.int64)
        tokens = torch.zeros(b, int(token_len.max()), dtype=torch.int64)
        for i, c in enumerate(chunks):
            tokens[i, :c.encoder_tokens.size] = torch.from_numpy(c.encoder_tokens)
        emb = torch.from_numpy(np.stack([c.state.speaker_embedding for c in chunks]))
        t0 = self.timer()
        mu, _, spks = self.encode(tokens, token_len, emb)
        self.observer.encoder_timed(tokens.numel(), self.timer() - t0)
        lengths = torch.tensor([c.frames for c in chunks], dtype=torch.int64)
        cond = condition(mu.float(), spks.float(), lengths, [torch.from_numpy(c.prefix_mel) for c in chunks])
        dev = mu.device  # GPU hosts: the encoder's output is on the GPU; the solve stays there
        solves = []
        for i, c in enumerate(chunks):
            a, f = c.skipped, c.frames   # frames read from the stream's cache are not solved
            x = torch.from_numpy(np.ascontiguousarray(c.start[:, a:])).to(dev)
            solves.append(RowSolve(mu=cond.mu[i, :, a:f], mask=cond.mask[i, :, a:f], spks=cond.spks[i],
                                   cond=cond.cond[i, :, a:f], x=x,
                                   grid=cfm_grid(c.steps, self.meanflow, cond.mu),
                                   rate=0.0 if self.meanflow else c.state.guidance_rate, past=c.past, keep=c.keep))
        return solves

    def replayed(self, c: Chunk, recorded: list[StepCaches]) -> None:
        """``c.replay`` was solved by the loop, keeping ``recorded``: the prompt cache ``c`` reads. Either a resumed
        stream's first chunk again on a fresh state (the solve that made the prompt cache the stream kept: it goes on
        as the undisturbed one, tests/test_snapshot.py), or a voice's prompt pass (held for its next streams)."""
        s = c.state
        s.cache = StreamCache.made(recorded, c.steps, c.prompt_frames, 0)
        if s.prompt_pass:
            self.prompt_pass_frames += c.prompt_frames * c.steps
            if self.voice_prompts is not None:   # the voice's: its next streams read it
                self.voice_prompts.put(self._prompt_key(s), s.cache)
        self._reuse(c)

    def fewer_steps(self, c: Chunk, solve: RowSolve, steps: int) -> None:
        """Solve ``c`` (its ``solve`` not begun) at ``steps`` Euler steps instead, on their own grid (a cosine grid
        of ``steps``, as a stream started with ``n_timesteps=steps`` would have): what the scheduler gives a chunk
        that cannot meet its stream's deadline at full steps. Its answer says so (``ChunkResult.steps``)."""
        if c.pinned or c.past is not None or solve.step or not 1 <= steps <= c.state.n_steps:
            raise ValueError(f"chunk of sequence {c.corr_id}: cannot solve at {steps} steps (pinned {c.pinned}, "
                             f"reads a kept cache {c.past is not None}, {solve.step} steps made, the "
                             f"stream's {c.state.n_steps})")
        c.steps = int(steps)
        solve.grid = cfm_grid(c.steps, self.meanflow, solve.mu)

    def commit(self, c: Chunk, x: np.ndarray, recorded: Optional[list[StepCaches]] = None) -> ChunkResult:
        """Apply a solved chunk to its sequence's state; the newly final frames. ``recorded``: the caches the solve
        kept (``c.keep`` frames, per Euler step), which the stream keeps (``keep_solved``)."""
        s = c.state
        tp, e = c.prompt_frames, s.emitted  # generated frame f sits at tp + f - first_frame in the start
        at = tp - c.skipped                 # ... and at tp - skipped + f - first_frame in the solve
        mel = x[:, at + e - c.first_frame:at + c.final_frames - c.first_frame].copy()
        if self.reuse != "none":
            context = self.context_frames if self.reuse == "context" else 0
            if c.past is not None:
                s.cache = s.cache.extended(recorded or [], c.keep, context)
            elif recorded:
                s.cache = StreamCache.made(recorded, c.steps, c.prompt_frames, context)
                first = self.reuse == "prompt" and s.received_tokens == 0 and c.steps == s.n_steps
                s.cache_tokens = c.tokens.copy() if first else None
        s.received_tokens += int(c.tokens.size)
        if c.tokens.size:
            s.tokens = np.concatenate([s.tokens, c.tokens])
        keep_from = 0
        if self.context_frames is not None:  # what a later chunk can still need: its context and on
            keep_from = max(0, c.final_frames - self.context_frames - TOKEN_MEL_RATIO)
            tail = mel.copy() if s.mel_tail is None else np.concatenate([s.mel_tail, mel], axis=1)
            s.mel_tail = tail[:, max(0, tail.shape[1] - (c.final_frames - keep_from)):]
            drop = keep_from // TOKEN_MEL_RATIO - s.token_offset   # tokens before the next context: never used
            if drop > 0:
                s.tokens, s.token_offset = s.tokens[drop:], s.token_offset + drop
        keep_from = max(keep_from, c.first_frame)
        s.noised_mels = (NoisedMels(c.start[:, tp + keep_from - c.first_frame:], keep_from)
                         if c.valid_frames > keep_from else None)
        s.emitted = c.final_frames
        result = ChunkResult(mel=mel, frame_offset=e, seed=s.noise.seed,
                             snapshot=b"" if c.finalize else self.snapshots.make(s), steps=c.steps)
        s.last = Answered(s.received_tokens - int(c.tokens.size), c.tokens, c.finalize, result)
        if c.replaced is not None:  # a START on a live id restarted that utterance: the old state went
            self.observer.sequence_dropped(c.corr_id, "replaced by a new START")
        work = Work(row_frames=float(c.nfe * c.solved_frames), steps=c.steps, chunks=1,
                    encoder_tokens=int(c.encoder_tokens.size), frames=int(mel.shape[1]),
                    skipped_row_frames=float((c.full_nfe - c.nfe) * c.solved_frames),
                    skipped_steps=c.state.n_steps - c.steps, key_row_frames=float(c.nfe * c.past_frames),
                    skipped_key_row_frames=float((c.full_nfe - c.nfe) * c.past_frames))
        # idle time counts from the answer, not the request; the stream's clock and work move on
        delivered = self.sequences.commit(c.corr_id, end=c.finalize, frames=int(mel.shape[1]), work=work.full())
        self.observer.chunk_work(c.corr_id, work)
        self.observer.chunk_answered(c.corr_id, c.started, c.nfe, int(mel.shape[1]), delivered)
        return result
