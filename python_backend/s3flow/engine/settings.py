"""The solver's settings, split by meaning: what a request may be, what an instance holds, what admission holds the
server to, how a chunk is solved, and the streams' deadlines.

=========================  =========================================  =========================================
part                       fields                                     read by
=========================  =========================================  =========================================
``RequestRules``           max_steps, max_guidance_rate,              ``s3flow.protocol.parse_request``
(``s3flow.protocol``)      max_prompt_tokens, max_chunk_tokens,
                           max_request_bytes
``SequenceLimits``         max_live_sequences, idle_timeout_s         ``s3flow.engine.sequences.SequenceTable``
(``engine.sequences``)
``AdmissionTarget``        utilization_target, expected_utterance_s   ``s3flow.serving.admission``, the load's
(``engine.capacity``)                                                 look-ahead and the planned START
``ChunkSolving``           context_frames, prompt_frames,             ``s3flow.engine.streaming.StreamingEngine``
                           slide_prompt, keep_solved,
                           voice_cache_mb, holdback_frames, default_steps,
                           default_guidance_rate,
                           max_utterance_frames
``DeadlineSettings``       start_buffer_s, first_audio_s,             the table's playback clocks (both
(``engine.scheduler``)     max_step_rows, max_step_row_frames,        schedulings); ``s3flow.engine.step_loop``
                           min_steps                                  (the ``deadline`` scheduling)
=========================  =========================================  =========================================

Every field is a ``parameters`` entry of the cfm_solver config, by its own name (the names are distinct
across the parts), and a ``scripts/build_repository.py`` flag. :class:`SolverSettings` holds the five parts and
moves them to and from that flat form. Which path serves the chunks (``scheduling: fifo | deadline``) is the
repository's choice (``RepositorySettings.scheduling``), read by the solver
instance (``s3flow.serving.solver_instance``).

Example::

    settings = SolverSettings.of(context_frames=-1, max_live_sequences=8)   # flat names, any part
    settings.solving.context_frames, settings.sequences.max_live_sequences
    SolverSettings.from_parameters(settings.parameters()) == settings
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from s3flow.engine.capacity import AdmissionTarget
from s3flow.engine.scheduler import DeadlineSettings
from s3flow.engine.sequences import SequenceLimits
from s3flow.protocol import NumericSettings, RequestRules, check_numbers


@dataclass
class ChunkSolving(NumericSettings):
    """How the engine solves a chunk (see ``s3flow.engine.streaming``)."""
    #: Streaming mode. -1: every chunk re-solves the whole prefix (cost grows with the utterance);
    #: C >= 0: bounded context, each chunk solves prompt + the last C emitted frames (as conditioning)
    #: + its new tokens. 100 (2 s): see results/streaming.md and the README.
    context_frames: int = 100
    #: The speaker prompt's share of a chunk's conditioning. -1: the whole prompt conditions every chunk (the
    #: default before 2026-12-02); P >= 0: only its last P frames (whole tokens) do, so a 10 s prompt costs
    #: what a P-frame one does. 50 (1 s): results/conditioning.md.
    prompt_frames: int = 50
    #: 0: the (capped) prompt conditions every chunk; 1: the emitted frames push it out, a bounded-context
    #: chunk's conditioning being the last ``context_frames`` frames of prompt ++ emitted mel (the voice's
    #: own frames replace the prompt's; the speaker embedding stays).
    slide_prompt: int = 0
    #: What a stream keeps of the frames it solved, so a later chunk does not solve them again
    #: (``s3flow.engine.reuse``): 0 nothing (every chunk solves the prompt and its context); 1 the prompt's
    #: estimator cache, from its first chunk; 2 the prompt's and the last ``context_frames`` emitted frames' (every
    #: frame solved once). Needs bounded context, the prompt not sliding, and an estimator that takes a cache.
    #: Quality and work: results/stream_reuse.md.
    keep_solved: int = 0
    #: With ``keep_solved`` 1 or 2: MB of prompt caches a solver instance holds for registered voices
    #: (``s3flow.engine.voice_prompts``): a stream started by a voice id reads its prompt's cache from its first
    #: chunk on, made once per voice, steps and guidance rate by a prompt pass; 0: such a stream solves its prompt
    #: in its first chunk as any stream. Ignored with ``keep_solved`` 0.
    voice_cache_mb: int = 0
    holdback_frames: int = 0              # generated frames withheld until the next chunk (or END)
    default_steps: int = 0                # 0: the checkpoint's default (10, or 2 for meanflow)
    default_guidance_rate: float = 0.7
    max_utterance_frames: int = 3000      # generated frames (60 s of audio)

    def check(self) -> None:
        check_numbers(self, "chunk setting", lowest={"holdback_frames": 0, "default_steps": 0,
                                                     "default_guidance_rate": 0, "context_frames": -1,
                                                     "prompt_frames": -1, "slide_prompt": 0, "keep_solved": 0,
                                                     "voice_cache_mb": 0})
        if self.slide_prompt not in (0, 1):
            raise ValueError(f"chunk setting slide_prompt must be 0 or 1, got {self.slide_prompt}")
        if self.slide_prompt and self.context_frames < 0:
            raise ValueError("chunk setting slide_prompt 1 needs bounded context (context_frames >= 0): "
                             "in prefix mode there is no window for the emitted frames to slide through")
        if self.keep_solved not in (0, 1, 2):
            raise ValueError(f"chunk setting keep_solved must be 0, 1 or 2, got {self.keep_solved}")
        if self.keep_solved and (self.context_frames < 0 or self.slide_prompt):
            raise ValueError(f"chunk setting keep_solved {self.keep_solved} needs bounded context (context_frames >= "
                             f"0) with the prompt not sliding (slide_prompt 0)")


_PARTS = {"rules": RequestRules, "sequences": SequenceLimits, "admission": AdmissionTarget, "solving": ChunkSolving,
          "deadlines": DeadlineSettings}


@dataclass(frozen=True)
class SolverSettings:
    """The solver's five kinds of settings (module docstring)."""
    rules: RequestRules = field(default_factory=RequestRules)
    sequences: SequenceLimits = field(default_factory=SequenceLimits)
    admission: AdmissionTarget = field(default_factory=AdmissionTarget)
    solving: ChunkSolving = field(default_factory=ChunkSolving)
    deadlines: DeadlineSettings = field(default_factory=DeadlineSettings)

    def __post_init__(self):
        self.check()

    @staticmethod
    def names() -> dict[str, object]:
        """Every field's flat name and default value."""
        return {f.name: f.default for cls in _PARTS.values() for f in dataclasses.fields(cls)}

    @classmethod
    def of(cls, **flat) -> "SolverSettings":
        """Settings from flat field names (each goes to its part); the rest keep their defaults."""
        unknown = set(flat) - set(cls.names())
        if unknown:
            raise TypeError(f"unknown solver settings {sorted(unknown)}")
        parts = {}
        for part, kind in _PARTS.items():
            mine = {f.name: flat[f.name] for f in dataclasses.fields(kind) if f.name in flat}
            parts[part] = kind(**mine)
        return cls(**parts)

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "SolverSettings":
        """From a config's ``parameters`` (string values; other keys ignored), each part checked."""
        return cls(**{part: kind.from_parameters(params) for part, kind in _PARTS.items()})

    def parameters(self) -> dict[str, object]:
        """The flat form: {field name: value} of every part."""
        return {k: v for part in _PARTS for k, v in dataclasses.asdict(getattr(self, part)).items()}

    def replace(self, **flat) -> "SolverSettings":
        """A copy with some flat fields changed."""
        return SolverSettings.of(**{**self.parameters(), **flat})

    def check(self) -> None:
        for part in _PARTS:
            getattr(self, part).check()
        if self.solving.default_steps > self.rules.max_steps:
            raise ValueError(f"default_steps {self.solving.default_steps} exceeds max_steps {self.rules.max_steps}")
        if self.solving.default_guidance_rate > self.rules.max_guidance_rate:
            raise ValueError(f"default_guidance_rate {self.solving.default_guidance_rate} exceeds max_guidance_rate "
                             f"{self.rules.max_guidance_rate}")
