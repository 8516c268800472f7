"""Small seeded model repositories for the measurements and their tests (needs the server package, torch).

The small flow config (``FlowConfig.small``) on seeded random weights, written with
``s3flow.repository.generator.write_repository`` into ``out/repo`` (the checkpoint beside it, in ``out/``)::

    from s3flow_tools.bench.repos import load_test_repository
    repo = load_test_repository(Path("/tmp/load"), streams=4)
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.engine.settings import SolverSettings
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import Batching, RepositorySettings

TRAINED_TEACHER = Path(__file__).resolve().parents[3] / "checkpoints" / "trained" / "teacher.safetensors"


def small_repository(out: Path, settings: RepositorySettings, *, seed: int = 0, vocoder: bool = False,
                     config: Optional[FlowConfig] = None) -> Path:
    """``out/repo`` for the flow ``config`` (default: the small one) on random weights from ``seed``; with
    ``vocoder``, a small seeded HiFT and ``token2wav`` too. Returns the repository's path."""
    out.mkdir(parents=True, exist_ok=True)
    flow = load_flow(write_random_checkpoint(out / "ckpt.safetensors", config or FlowConfig.small(), seed=seed))
    hift = None
    if vocoder:
        from s3flow.model.vocoder import VocoderConfig, random_vocoder
        hift = random_vocoder(VocoderConfig.small(), seed=seed)
    write_repository(out / "repo", flow, settings, vocoder=hift)
    return out / "repo"


def trained_repository(out: Path, settings: RepositorySettings) -> Path:
    """``out/repo`` for the small teacher trained here (``checkpoints/trained/``) with a small seeded HiFT
    (``token2wav`` too). Returns the repository's path."""
    from s3flow.model.vocoder import VocoderConfig, random_vocoder

    write_repository(out / "repo", load_flow(TRAINED_TEACHER), settings,
                     vocoder=random_vocoder(VocoderConfig.small(), seed=0))
    return out / "repo"


def load_test_repository(out: Path, *, streams: int = 16, seed: int = 0, idle_timeout_s: float = 60.0,
                         scheduling: str = "fifo", vocoder: bool = False) -> Path:
    """The load test's cpu repository: capacity sized for ``streams`` concurrent streams, batches of up to 8
    chunks with a 2 ms queue delay, one ONNX Runtime thread per model; ``scheduling`` fifo or deadline, with
    ``vocoder`` a small HiFT and ``token2wav`` too."""
    solver = SolverSettings.of(max_steps=20, max_live_sequences=max(4 * streams, 8), idle_timeout_s=idle_timeout_s)
    settings = RepositorySettings(solver=solver, batching=Batching(max_batch_size=8, max_queue_delay_us=2000),
                                  ort_threads=1, scheduling=scheduling)
    return small_repository(out, settings, seed=seed, vocoder=vocoder)


def warmup_repository(out: Path, warmup: bool, seed: int = 0) -> Path:
    """The warm-up measurement's repository (with ``token2wav``), Triton ``model_warmup`` and the stateful
    models' warm-up at load on or off (``RepositorySettings.warmup``)."""
    settings = RepositorySettings(solver=SolverSettings.of(max_steps=20, max_live_sequences=8),
                                  batching=Batching(max_queue_delay_us=2000, max_candidate_sequences=16),
                                  ort_threads=1, warmup=warmup)
    return small_repository(out, settings, seed=seed, vocoder=True)
