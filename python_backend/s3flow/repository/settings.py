"""What a generated model repository is built for: the target, the solver's settings, the batching knobs, the
backends and the voice registry (dataclasses; the defaults live here and nowhere else).

Example::

    from s3flow.repository.settings import Batching, RepositorySettings
    settings = RepositorySettings(target="gpu", batching=Batching(max_batch_size=4))
    settings.check()                     # ValueError naming the bad value, before anything is written
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from s3flow.engine.settings import SolverSettings
from s3flow.engine.scheduler import check_bucket_ratio
from s3flow.runtime.torch_runner import DEFAULT_ESTIMATOR_DTYPE, DTYPES

Target = Literal["cpu", "gpu"]

#: Seconds Triton keeps an idle sequence after the solver's (and the vocoder's) idle timeout, by target, unless
#: ``RepositorySettings.triton_idle_grace_s`` says otherwise. Triton counts a sequence idle while its chunk
#: computes (no request of it queued), so the grace must exceed the longest chunk: milliseconds on a GPU; on 2 CPU
#: cores the full-size model's last chunk of a 10 s utterance took over 10 s (scripts/benchmark.py lost that
#: sequence with a 5 s grace).
TRITON_IDLE_GRACE_S = {"cpu": 30.0, "gpu": 5.0}
#: The instances of the solver and the estimator by target, where ``Batching`` names none (results/layout.md,
#: docs/operations.md "Which layout"). CPU: two solver instances beside two estimator instances of half the cores
#: each, so that one solver's Python, encoder call and bookkeeping overlap the other's estimator calls (one of
#: each leaves the estimator idle while the solver works, and the solver idle while it waits). GPU: one of each,
#: so that every estimator call carries the rows of all the streams (a GPU's cost is per call, not per row: the
#: H200's eager estimator call costs the same 27 ms at 100 and 600 frames, results/gpu_check.md); the overlap
#: there must come from the solver's loop preparing a step while the previous one runs, not from more instances.
DEFAULT_INSTANCES = {"cpu": {"solver_instances": 2, "estimator_instances": 2},
                     "gpu": {"solver_instances": 1, "estimator_instances": 1}}
#: The chunk solving of a target's repository where its build names none (``s3flow.repository.cli``). CPU: each
#: stream keeps its prompt's cache from its first chunk and reads 25 frames of context (``keep_solved`` 1,
#: ``context_frames`` 25): 1.30x the saturation throughput of keeping nothing with 100 frames
#: (results/keep_prompt_c25.md), more streams at once before one runs dry (results/at_once.md), its paired quality
#: within the seed spread (results/stream_reuse.md), a resume still exact (the first chunk solved again,
#: docs/streaming.md); a first answer about 20 ms later. Registered voices hold their prompt's cache (256 MB a solver
#: instance, ``voice_cache_mb``: 6.5 MB a voice of the trained small teacher, 221 MB at full size, guided 10
#: steps), so a stream started by voice id solves no prompt frames (1.05x one request's frames at 5 s; paired
#: quality within the seed spread, results/stream_reuse_voice.md). GPU: nothing kept, 100 frames, until the
#: TensorRT plans take a cache (the repository refuses ``keep_solved`` with them).
DEFAULT_SOLVING = {"cpu": {"keep_solved": 1, "context_frames": 25, "voice_cache_mb": 256}, "gpu": {}}
GPU_BACKENDS = ("tensorrt", "torch")
SCHEDULING = ("fifo", "deadline")


@dataclass
class Batching:
    """Server-side batching knobs of the solver (see the README's batching section)."""
    strategy: Literal["oldest", "direct"] = "oldest"
    max_batch_size: int = 8                 # chunks of different utterances in one execute
    preferred_batch_sizes: tuple = ()
    max_queue_delay_us: int = 2000          # how long a chunk may wait for others to join its batch
    #: oldest: sequences Triton lets into the batcher at once. More than the solver's max_live_sequences,
    #: so that a START beyond that reaches the solver and is refused at once ("retry in N s") rather than
    #: waiting silently in Triton's backlog; the headroom also holds refused STARTs and abandoned sequences
    #: until their slots are reclaimed (idle_timeout_s + 5 s).
    max_candidate_sequences: int = 256
    solver_instances: Optional[int] = None  # None: the target's (DEFAULT_INSTANCES)
    estimator_instances: Optional[int] = None
    encoder_instances: int = 1
    #: the ensembles' first step (s3flow.serving.admission). More than one: each counts only the STARTs it admitted
    #: itself until the solver holds them, so a burst gets up to that many times one instance's share (measured:
    #: 2 instances admitted 6 of a 10 C burst where one admits 3, docs/reliability.md)
    admission_instances: int = 1
    #: admission takes the requests queued for it in one execute (Triton's dynamic batcher, no delay); off: one
    #: request an execute. A burst of 100 STARTs refused busy is answered no sooner with it (results/refusals.md)
    admission_batching: bool = False
    length_bucket_ratio: float = 0.0        # >= 1: split a batch where a prefix is > this x the shortest; 0: off

    def check(self) -> None:
        if self.strategy not in ("oldest", "direct"):
            raise ValueError(f"strategy must be 'oldest' or 'direct', got {self.strategy!r}")
        for name in ("max_batch_size", "max_candidate_sequences", "solver_instances", "estimator_instances",
                     "encoder_instances", "admission_instances"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_bucket_ratio(self.length_bucket_ratio, "length_bucket_ratio")
        if any(not 1 <= p <= self.max_batch_size for p in self.preferred_batch_sizes):
            raise ValueError(f"preferred_batch_sizes must lie in [1, {self.max_batch_size}], "
                             f"got {list(self.preferred_batch_sizes)}")


@dataclass
class VoiceSettings:
    """The voice registry (s3flow.serving.voice_registry): where voices live and how many may stay."""
    voice_dir: str = ""                     # "": a folder per server run (voices survive nothing)
    max_voices: int = 1000
    max_voice_bytes: int = 256 << 20
    enabled: bool = False                   # set by write_repository when it writes voice_encoder

    def check(self) -> None:
        if self.max_voices < 1 or self.max_voice_bytes < 1:
            raise ValueError(f"max_voices and max_voice_bytes must be >= 1, got {self.max_voices}, "
                             f"{self.max_voice_bytes}")


@dataclass
class RepositorySettings:
    target: Target = "cpu"
    solver: SolverSettings = field(default_factory=SolverSettings)
    batching: Batching = field(default_factory=Batching)
    ort_threads: int = 0                    # ONNX Runtime intra-op threads (0: all cores)
    #: the cpu target's flow encoder lets its idle ONNX Runtime threads spin for work (``allow_spinning``). Off:
    #: called once per chunk between estimator calls, a spinning pool burned 1.1 s of CPU over six streams alone
    #: against 0.08 s of work, C and a stream alone unchanged within noise (results/encoder_spinning.md)
    encoder_spinning: bool = False
    #: the same for the vocoder's two ONNX Runtime sessions (called once per chunk answer on token2wav): spinning,
    #: they burned 3.65 s of CPU over six streams alone against 1.47 s, and token2wav's C was 0.79x (5.41 against 6.81
    #: s of audio per s; results/vocoder_spinning.md)
    vocoder_spinning: bool = False
    torch_threads: int = 1                  # the solver's own torch work is small
    gpu_backend: Literal["tensorrt", "torch"] = "tensorrt"  # gpu target: TensorRT plans or torch on CUDA
    #: gpu_backend torch: the estimator's compute dtype (fp32, bf16 or fp16; the encoder stays fp32)
    torch_dtype: Literal["fp32", "bf16", "fp16"] = DEFAULT_ESTIMATOR_DTYPE
    warmup: bool = True                     # warm every model up at load (s3flow.serving.warmup)
    #: the ensembles' admission step ahead of the solver (s3flow.serving.admission: a refused START takes no
    #: sequence slot); False: the request goes straight to cfm_solver, as before (measurements, experiments)
    admission: bool = True
    vocoder_backend: Literal["auto", "onnx", "torch"] = "auto"  # auto: torch on the GPU (gpu), onnx (cpu)
    voices: VoiceSettings = field(default_factory=VoiceSettings)
    #: seconds Triton keeps an idle sequence after the models' idle timeout (None: TRITON_IDLE_GRACE_S[target])
    triton_idle_grace_s: Optional[float] = None
    #: how cfm_solver serves chunks: "fifo" (Triton's oldest batcher hands it batches of chunks, each solved whole
    #: in one execute) or "deadline" (its own loop, answering through response senders, runs one Euler step at a time over the chunks of
    #: many streams, most urgent first; s3flow.engine.step_loop, s3flow.serving.solver_instance)
    scheduling: Literal["fifo", "deadline"] = "fifo"

    def __post_init__(self):
        """Instance counts the batching leaves open are the target's (``DEFAULT_INSTANCES``)."""
        chosen = {k: v for k, v in DEFAULT_INSTANCES.get(self.target, {}).items() if getattr(self.batching, k) is None}
        if chosen:
            self.batching = dataclasses.replace(self.batching, **chosen)

    @property
    def idle_grace_s(self) -> float:
        return TRITON_IDLE_GRACE_S[self.target] if self.triton_idle_grace_s is None else self.triton_idle_grace_s

    def triton_idle_us(self, idle_timeout_s: float) -> int:
        """Triton's ``max_sequence_idle_microseconds`` for a model that evicts after ``idle_timeout_s``: a
        late chunk reaches the model and gets its clear "evicted after N s idle" rather than Triton's "must
        specify START", and a chunk computing for up to the grace is not taken for idleness."""
        return int((idle_timeout_s + self.idle_grace_s) * 1e6)

    def check(self) -> None:
        """Every part's own check, and the rules between them; ValueError names the bad value."""
        if self.target not in ("cpu", "gpu"):
            raise ValueError(f"target must be 'cpu' or 'gpu', got {self.target!r}")
        self.solver.check()
        self.batching.check()
        self.voices.check()
        b, live = self.batching, self.solver.sequences.max_live_sequences
        if b.strategy == "oldest" and live >= b.max_candidate_sequences:
            raise ValueError(
                f"max_live_sequences ({live}) must be below max_candidate_sequences "
                f"({self.batching.max_candidate_sequences}): Triton would queue the extra utterances silently "
                f"instead of the solver refusing them; raise max_candidate_sequences or lower max_live_sequences")
        if self.gpu_backend not in GPU_BACKENDS:
            raise ValueError(f"gpu_backend must be 'tensorrt' or 'torch', got {self.gpu_backend!r}")
        if self.torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype must be one of {sorted(DTYPES)}, got {self.torch_dtype!r}")
        if not self.idle_grace_s > 0:
            raise ValueError(f"triton_idle_grace_s must be > 0, got {self.idle_grace_s}")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"scheduling must be one of {SCHEDULING}, got {self.scheduling!r}")
        if self.keeps_solved and self.target == "gpu" and self.gpu_backend == "tensorrt":
            raise ValueError(f"keep_solved {self.solver.solving.keep_solved} needs the estimator served by ONNX "
                             f"Runtime (cpu target) or torch (gpu_backend torch): the TensorRT plans have no cache "
                             f"inputs yet")

    @property
    def keeps_solved(self) -> bool:
        """The solver keeps what streams solved: the estimator serves the cached graph (``keep_solved``)."""
        return self.solver.solving.keep_solved > 0

    @property
    def graphs_by_call(self) -> bool:
        """The cached estimator serves each call the smallest graph it needs: the plain graph to a call whose rows
        read no cache and keep nothing (one request: the cached graph's extra nodes made a 30 s one request
        1.18-1.23x slower, results/stream_work_default.md), a read-only cached graph to one that keeps nothing (a
        stream's chunks after its first), the cached graph to one that keeps. On the cpu target, where the
        estimator's Triton model is ours."""
        return self.keeps_solved and self.target == "cpu"
