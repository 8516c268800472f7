"""Measuring the small trained models on held-out utterances: quality per solver, and streamed vs offline.

* the held-out inputs (``s3flow_training.package.HeldoutUtterance``) come from the corpus or the shipped
  ``heldout.npz``.
* ``evaluate_methods`` runs each ``Method`` (teacher guided 10 / 2 steps, teacher unguided 10, student
  2 / 1 steps) from the same ``FrameNoise`` seed per utterance and reports mel error against the ground
  truth and against the guided 10-step teacher, a detail ratio, estimator calls and wall time.
* ``stream_utterance`` streams one utterance chunk by chunk through ``s3flow.engine.streaming.StreamingEngine`` in
  process; ``stream_vs_offline`` compares that with offline synthesis of the same tokens and seed, near
  chunk seams and away.
* ``PairedMetric`` holds one metric of one row for two folders' models (shipped and a candidate) per
  sentence, at the table's seeds and at other seeds; ``paired_summary`` gives the mean paired difference, its
  t-interval, the seed spread and a verdict (``paired_verdict``); ``paired_to_json`` / ``paired_from_json``
  keep the per-sentence values.

Example::

    utts = load_heldout("checkpoints/trained/heldout.npz")
    rows, outputs = evaluate_methods(load_flow(teacher_path), load_flow(student_path), utts)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from s3flow_contract.tensors import request_arrays
from s3flow.model.flow import S3Flow, TorchEstimator, synthesize
from s3flow.engine.settings import SolverSettings
from s3flow.model.solver import CountingEstimator
from s3flow.engine.streaming import StreamingEngine
from s3flow.serving.local_stream import stream_in_process
from s3flow.serving.session import SolverSession
from s3flow_training.package import HeldoutUtterance


# ---------------------------------------------------------------------------------------------------
# Solvers compared


@dataclass(frozen=True)
class Method:
    """A way to make mel: which model, Euler steps, guidance rate (None for the meanflow student)."""
    name: str
    model: str          # "teacher" or "student"
    n_steps: int
    guidance_rate: Optional[float]

    @property
    def rows_per_call(self) -> int:
        """Batch rows per estimator call for one utterance (guidance doubles the batch)."""
        return 2 if self.guidance_rate else 1


METHODS: tuple[Method, ...] = (
    Method("teacher, guided (w = 0.7), 10 steps", "teacher", 10, 0.7),
    Method("teacher, guided (w = 0.7), 2 steps", "teacher", 2, 0.7),
    Method("teacher, unguided, 10 steps", "teacher", 10, 0.0),
    Method("student (meanflow), 2 steps", "student", 2, None),
    Method("student (meanflow), 1 step", "student", 1, None),
)
REFERENCE = METHODS[0]


def synthesize_one(flow: S3Flow, u: HeldoutUtterance, n_steps: int, guidance_rate: Optional[float],
                   seed: int = 0) -> tuple[np.ndarray, int]:
    """(n_feats, 2 N) mel for one utterance from FrameNoise(seed), and the estimator calls made."""
    est = CountingEstimator(TorchEstimator(flow.estimator))
    out = synthesize(flow, torch.from_numpy(u.speech_tokens)[None], torch.from_numpy(u.prompt_tokens)[None],
                     torch.from_numpy(np.ascontiguousarray(u.prompt_mel.T))[None],
                     torch.from_numpy(u.xvector)[None], seed=seed, n_steps=n_steps,
                     guidance_rate=0.0 if guidance_rate is None else guidance_rate, estimator=est)
    return out.mel[0].numpy(), est.nfe


def detail(mel: np.ndarray) -> float:
    """Mean absolute frame-to-frame change: how much fine temporal structure a mel has."""
    return float(np.abs(np.diff(mel, axis=1)).mean())


@dataclass
class MethodResult:
    """Errors are frame-weighted means over all utterances and mel bins (log-mel units)."""
    method: Method
    mae_gt: float
    mse_gt: float
    mae_ref: float
    mse_ref: float
    detail_ratio: float      # detail(output) / detail(ground truth), 1 = as much structure as real mel
    calls: int               # estimator calls per utterance
    wall_s: float            # total over the utterances (batch of one each)
    per_utt_mae_gt: list = field(default_factory=list)

    @property
    def evaluations(self) -> int:
        """Network evaluations per utterance, counted in batch rows."""
        return self.calls * self.method.rows_per_call


def evaluate_methods(teacher: S3Flow, student: S3Flow, utts: Sequence[HeldoutUtterance],
                     methods: Sequence[Method] = METHODS, seed: int = 0):
    """Run every method on every utterance (same noise per utterance); returns (results, outputs) with
    outputs[method.name] the list of mels."""
    models = {"teacher": teacher.eval(), "student": student.eval()}
    outputs, walls, calls = {}, {}, {}
    for m in methods:
        flow = models[m.model]
        t0 = time.perf_counter()
        outs = []
        for k, u in enumerate(utts):
            mel, nfe = synthesize_one(flow, u, m.n_steps, m.guidance_rate, seed=seed + k)
            outs.append(mel)
        walls[m.name], calls[m.name], outputs[m.name] = time.perf_counter() - t0, nfe, outs
    ref = outputs[methods[0].name]
    gt_detail = np.mean([detail(u.mel) for u in utts])
    frames = sum(u.frames for u in utts) * utts[0].mel.shape[0]
    results = []
    for m in methods:
        outs = outputs[m.name]
        results.append(MethodResult(
            method=m,
            mae_gt=sum(np.abs(o - u.mel).sum() for o, u in zip(outs, utts)) / frames,
            mse_gt=sum(((o - u.mel) ** 2).sum() for o, u in zip(outs, utts)) / frames,
            mae_ref=sum(np.abs(o - r).sum() for o, r in zip(outs, ref)) / frames,
            mse_ref=sum(((o - r) ** 2).sum() for o, r in zip(outs, ref)) / frames,
            detail_ratio=float(np.mean([detail(o) for o in outs]) / gt_detail),
            calls=calls[m.name], wall_s=walls[m.name],
            per_utt_mae_gt=[float(np.abs(o - u.mel).mean()) for o, u in zip(outs, utts)]))
    return results, outputs


# ---------------------------------------------------------------------------------------------------
# Streamed vs offline


@dataclass
class StreamingComparison:
    """|streamed - offline| over frames within ``radius`` frames of a chunk seam and over the others."""
    name: str
    seams: int
    seam_frames: int
    other_frames: int
    mae_seam: float
    mae_other: float
    max_seam: float
    max_other: float
    mae_vs_gt_streamed: float
    mae_vs_gt_offline: float


@dataclass
class Streamed:
    """One utterance streamed: mel (n_feats, 2 N) assembled, the frame offsets where chunks 2, 3, ...
    began, each chunk's latency, and the estimator frames x NFE of all its solves."""
    mel: np.ndarray
    seams: list
    latency_s: list
    solved_frames: int


def stream_utterance(flow: S3Flow, u: HeldoutUtterance, chunks: Sequence[int], seed: int = 0,
                     n_steps: Optional[int] = None, settings: Optional[SolverSettings] = None,
                     by_voice: bool = False) -> Streamed:
    """Stream one utterance through the served chunk logic in process (``SolverSession`` over a
    ``StreamingEngine`` with ``settings``, default the served defaults; torch modules as the networks).
    ``by_voice``: the START names a registered voice holding ``u``'s prompt (``settings`` with ``voice_cache_mb``:
    its prompt pass, ``s3flow.engine.voice_prompts``, is left out of ``solved_frames``: a voice pays it once)."""
    def encode(tokens, token_len, embedding):
        with torch.inference_mode():
            return flow.encoder(tokens, token_len, embedding)

    settings = settings or SolverSettings()
    engine = StreamingEngine(encode, TorchEstimator(flow.estimator), n_feats=flow.config.n_feats,
                             meanflow=flow.config.meanflow, solving=settings.solving, limits=settings.sequences)
    prompt = dict(prompt_tokens=u.prompt_tokens, prompt_mel=np.ascontiguousarray(u.prompt_mel.T),
                  speaker_embedding=u.xvector)
    voices = None
    if by_voice:
        arrays = request_arrays(np.zeros(0, np.int64), start=True, **prompt)
        held = {k: arrays[k] for k in prompt}
        voices = lambda voice_id, tenant: held   # noqa: E731
        prompt = dict(voice_id="v-eval")
    got = stream_in_process(SolverSession(engine, settings.rules, voices=voices), u.speech_tokens, chunks,
                            seed=seed, n_timesteps=n_steps, **prompt)
    return Streamed(got.mel, got.seams, got.latencies_s, engine.solved_frames - engine.prompt_pass_frames)


def stream_vs_offline(flow: S3Flow, utts: Sequence[HeldoutUtterance], name: str,
                      chunks_for=None, radius: int = 3, seed: int = 0,
                      n_steps: Optional[int] = None, settings: Optional[SolverSettings] = None) -> StreamingComparison:
    """Stream each utterance with ``chunks_for(n_tokens)`` chunk sizes and compare with offline synthesis
    (same tokens, prompt and seed). Seam frames: within ``radius`` frames of a chunk boundary. Default
    ``settings``: the prefix re-run mode."""
    settings = settings or SolverSettings.of(context_frames=-1, prompt_frames=-1)
    from s3flow_client import chunk_schedule
    chunks_for = chunks_for or (lambda n: chunk_schedule(n, 10, 2.0, 100))
    seam_err, other_err, gt_s, gt_o, n_seams = [], [], [], [], 0
    for k, u in enumerate(utts):
        got = stream_utterance(flow, u, chunks_for(len(u.speech_tokens)), seed=seed + k, n_steps=n_steps,
                               settings=settings)
        streamed, seams = got.mel, got.seams
        offline, _ = synthesize_one(flow, u, n_steps or (2 if flow.config.meanflow else 10),
                                    None if flow.config.meanflow else 0.7, seed=seed + k)
        assert streamed.shape == offline.shape == u.mel.shape, (streamed.shape, offline.shape, u.mel.shape)
        err = np.abs(streamed - offline)
        near = np.zeros(u.frames, bool)
        for s in seams:
            near[max(0, s - radius):s + radius] = True
        n_seams += len(seams)
        seam_err.append(err[:, near])
        other_err.append(err[:, ~near])
        gt_s.append(np.abs(streamed - u.mel).mean())
        gt_o.append(np.abs(offline - u.mel).mean())
    se, oe = np.concatenate(seam_err, axis=1), np.concatenate(other_err, axis=1)
    return StreamingComparison(name, n_seams, se.shape[1], oe.shape[1], float(se.mean()), float(oe.mean()),
                               float(se.max()), float(oe.max()), float(np.mean(gt_s)), float(np.mean(gt_o)))


# ---------------------------------------------------------------------------------------------------
# Candidate vs shipped, paired per sentence

#: The verdicts of :func:`paired_verdict`.
BETTER, WORSE, NO_DIFFERENCE = "candidate better", "candidate worse", "no difference"
#: The paired interval's coverage.
CONFIDENCE = 0.95


@dataclass(frozen=True)
class PairedMetric:
    """One metric of one audio row for two folders' models on the same sentences and seeds.

    ``shipped`` / ``candidate``: per sentence (n,) at the table's seeds; ``*_reseeded``: the same sentences
    with every noise seed changed (both folders alike). ``higher_is_better``: STOI and ESTOI yes, mel error no.
    """
    row: str
    metric: str
    higher_is_better: bool
    shipped: tuple
    candidate: tuple
    shipped_reseeded: tuple
    candidate_reseeded: tuple

    def __post_init__(self):
        n = len(self.shipped)
        if not (len(self.candidate) == len(self.shipped_reseeded) == len(self.candidate_reseeded) == n):
            raise ValueError(f"{self.row} / {self.metric}: per-sentence lists differ in length: "
                             f"{[len(v) for v in self.values()]}")

    def values(self) -> tuple:
        return self.shipped, self.candidate, self.shipped_reseeded, self.candidate_reseeded

    @property
    def differences(self) -> np.ndarray:
        """(n,) candidate - shipped per sentence, the table's seeds."""
        return np.asarray(self.candidate, np.float64) - np.asarray(self.shipped, np.float64)

    @property
    def reseeded_differences(self) -> np.ndarray:
        """(n,) candidate - shipped per sentence, the other seeds."""
        return np.asarray(self.candidate_reseeded, np.float64) - np.asarray(self.shipped_reseeded, np.float64)

    def summary(self) -> "PairedSummary":
        return paired_summary(self.differences, self.reseeded_differences, self.higher_is_better,
                              float(np.mean(self.shipped)), float(np.mean(self.candidate)))


@dataclass(frozen=True)
class PairedSummary:
    """The paired comparison of one metric (see :func:`paired_summary`)."""
    n: int
    mean_shipped: float
    mean_candidate: float
    mean_difference: float           # mean over sentences of candidate - shipped (the table's seeds)
    interval: tuple                  # CONFIDENCE t-interval of that mean (nan, nan) below 2 sentences
    mean_difference_reseeded: float  # the same mean with every noise seed changed
    seed_spread: float               # |mean_difference_reseeded - mean_difference|
    verdict: str


def t_interval(values: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Student-t interval of the mean of ``values`` (n,); (nan, nan) for fewer than 2 values."""
    from scipy.stats import t

    values = np.asarray(values, np.float64)
    n = len(values)
    if n < 2:
        return float("nan"), float("nan")
    mean, half = float(values.mean()), 0.0
    sd = float(values.std(ddof=1))
    if sd > 0:
        half = float(t.ppf(0.5 + confidence / 2, n - 1)) * sd / np.sqrt(n)
    return mean - half, mean + half


def paired_verdict(mean_difference: float, interval: tuple, seed_spread: float, higher_is_better: bool) -> str:
    """``candidate better`` (worse) where the gain (mean difference signed so that positive is better) is
    positive (negative), the interval excludes 0 and ``|mean difference| > seed_spread``; else ``no
    difference``."""
    lo, hi = interval
    excludes_zero = bool(lo > 0 or hi < 0)            # False for a nan interval
    if not (excludes_zero and abs(mean_difference) > seed_spread):
        return NO_DIFFERENCE
    gain = mean_difference if higher_is_better else -mean_difference
    return BETTER if gain > 0 else WORSE


def paired_summary(differences: np.ndarray, reseeded: np.ndarray, higher_is_better: bool,
                   mean_shipped: float = float("nan"), mean_candidate: float = float("nan")) -> PairedSummary:
    """Mean paired difference, its t-interval, the seed spread and the verdict.

    differences, reseeded: (n,) candidate - shipped per sentence at the table's seeds and with every noise
    seed changed. The seed spread is how far the mean paired difference moves when only the seeds change.
    """
    differences, reseeded = np.asarray(differences, np.float64), np.asarray(reseeded, np.float64)
    mean, mean_reseeded = float(differences.mean()), float(reseeded.mean())
    interval = t_interval(differences)
    spread = abs(mean_reseeded - mean)
    return PairedSummary(len(differences), mean_shipped, mean_candidate, mean, interval, mean_reseeded, spread,
                         paired_verdict(mean, interval, spread, higher_is_better))


def paired_to_json(metrics: Sequence[PairedMetric]) -> list[dict]:
    """Each metric's per-sentence values and summary as JSON-ready dicts (read back by ``paired_from_json``)."""
    out = []
    for m in metrics:
        s = m.summary()
        out.append({"row": m.row, "metric": m.metric, "higher_is_better": m.higher_is_better,
                    "shipped": list(m.shipped), "candidate": list(m.candidate),
                    "shipped_reseeded": list(m.shipped_reseeded), "candidate_reseeded": list(m.candidate_reseeded),
                    "summary": {"n": s.n, "mean_difference": s.mean_difference,
                                "interval": [None if np.isnan(v) else v for v in s.interval],
                                "mean_difference_reseeded": s.mean_difference_reseeded,
                                "seed_spread": s.seed_spread, "verdict": s.verdict}})
    return out


def paired_from_json(items: Sequence[dict]) -> list[PairedMetric]:
    """The metrics ``paired_to_json`` wrote (their summaries are recomputed from the per-sentence values)."""
    return [PairedMetric(d["row"], d["metric"], bool(d["higher_is_better"]), tuple(d["shipped"]),
                         tuple(d["candidate"]), tuple(d["shipped_reseeded"]), tuple(d["candidate_reseeded"]))
            for d in items]
