"""Measuring the small trained models on held-out utterances: quality per solver, and streamed vs offline.

* ``heldout_utterances`` turns held-out corpus entries into self-contained inputs (tokens, a prompt cut
  from another held-out utterance of the same voice, x-vector, ground-truth mel); ``save_heldout`` /
  ``load_heldout`` keep a few of them in an .npz so tests and demos need no espeak-ng.
* ``evaluate_methods`` runs each ``Method`` (teacher guided 10 / 2 steps, teacher unguided 10, student
  2 / 1 steps) from the same ``FrameNoise`` seed per utterance and reports mel error against the ground
  truth and against the guided 10-step teacher, a detail ratio, estimator calls and wall time.
* ``stream_utterance`` streams one utterance chunk by chunk through ``s3flow.engine.streaming.StreamingEngine`` in
  process; ``stream_vs_offline`` compares that with offline synthesis of the same tokens and seed, near
  chunk seams and away.

Example::

    utts = load_heldout("checkpoints/trained/heldout.npz")
    rows, outputs = evaluate_methods(load_flow(teacher_path), load_flow(student_path), utts)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from s3flow.model.flow import S3Flow, TorchEstimator, synthesize
from s3flow.protocol import Limits, parse_request
from s3flow.model.solver import CountingEstimator, FrameNoise
from s3flow.engine.streaming import StreamingEngine
from s3flow_training.data import Dataset, prompt_for


@dataclass
class HeldoutUtterance:
    """One held-out input: speech_tokens (N,), prompt_tokens (Np,), prompt_mel (n_feats, 2 Np)
    channels-major, xvector (192,), mel (n_feats, 2 N) the ground truth of the speech tokens."""
    speech_tokens: np.ndarray
    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray
    xvector: np.ndarray
    mel: np.ndarray
    text: str = ""
    voice: int = -1

    @property
    def frames(self) -> int:
        return int(self.mel.shape[1])


def heldout_utterances(ds: Dataset, indices: Optional[Sequence[int]] = None, seed: int = 0,
                       prompt_tokens: tuple[int, int] = (40, 60)) -> list[HeldoutUtterance]:
    """Held-out entries of ``ds`` (default all) with a seeded prompt from another held-out utterance of
    the same voice (1.6 to 2.4 s)."""
    rng = np.random.default_rng([seed, 30])
    out = []
    for i in (ds.split(heldout=True) if indices is None else indices):
        u = ds.utterances[i]
        pt, pm = prompt_for(ds, i, rng, *prompt_tokens)
        out.append(HeldoutUtterance(u.tokens.copy(), pt, pm, ds.xvectors[u.voice].copy(), u.mel.copy(),
                                    u.text, u.voice))
    return out


def save_heldout(path: str | Path, utts: Sequence[HeldoutUtterance]) -> Path:
    """Write utterances as padded arrays with lengths (numpy only, no pickles)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = np.array([len(u.speech_tokens) for u in utts])
    npr = np.array([len(u.prompt_tokens) for u in utts])
    c = utts[0].mel.shape[0]
    st = np.zeros((len(utts), n.max()), np.int64)
    pt = np.zeros((len(utts), npr.max()), np.int64)
    pm = np.zeros((len(utts), c, 2 * npr.max()), np.float32)
    mel = np.zeros((len(utts), c, 2 * n.max()), np.float32)
    for k, u in enumerate(utts):
        st[k, :n[k]], pt[k, :npr[k]] = u.speech_tokens, u.prompt_tokens
        pm[k, :, :2 * npr[k]], mel[k, :, :2 * n[k]] = u.prompt_mel, u.mel
    np.savez_compressed(path, speech_tokens=st, speech_token_len=n, prompt_tokens=pt, prompt_token_len=npr,
                        prompt_mel=pm, xvector=np.stack([u.xvector for u in utts]).astype(np.float32),
                        mel=mel, text=np.array([u.text for u in utts]), voice=np.array([u.voice for u in utts]))
    return path


def load_heldout(path: str | Path) -> list[HeldoutUtterance]:
    with np.load(path, allow_pickle=False) as f:
        d = {k: f[k] for k in f.files}
    out = []
    for k, (n, npr) in enumerate(zip(d["speech_token_len"], d["prompt_token_len"])):
        out.append(HeldoutUtterance(d["speech_tokens"][k, :n].copy(), d["prompt_tokens"][k, :npr].copy(),
                                    d["prompt_mel"][k, :, :2 * npr].copy(), d["xvector"][k].copy(),
                                    d["mel"][k, :, :2 * n].copy(), str(d["text"][k]), int(d["voice"][k])))
    return out


def save_demo_input(path: str | Path, u: HeldoutUtterance, seed: int = 0, n_timesteps: int = 10) -> Path:
    """One utterance in ``scripts/flow_infer.py``'s input format (speech_tokens (1, N), prompt_tokens
    (1, Np), prompt_feat (1, 2 Np, n_feats) frames-major, embedding (1, 192), z = FrameNoise(seed) over
    prompt + speech, n_timesteps, finalize), which ``python -m s3flow_client --inputs`` also reads; plus
    ``mel`` (1, n_feats, 2 N), the ground truth, and ``text``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    c, tp = u.prompt_mel.shape
    z = FrameNoise(seed, c).full(tp, u.frames)
    np.savez(path, speech_tokens=u.speech_tokens[None].astype(np.int64),
             prompt_tokens=u.prompt_tokens[None].astype(np.int64),
             prompt_feat=np.ascontiguousarray(u.prompt_mel.T[None]).astype(np.float32),
             embedding=u.xvector[None].astype(np.float32), z=z[None].astype(np.float32),
             n_timesteps=np.int64(n_timesteps), finalize=np.bool_(True), mel=u.mel[None].astype(np.float32),
             text=np.array(u.text))
    return path


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
                     n_steps: Optional[int] = None, limits: Optional[Limits] = None) -> Streamed:
    """Stream one utterance through a StreamingEngine (the served chunk logic, in process)."""
    def encode(tokens, token_len, embedding):
        with torch.inference_mode():
            return flow.encoder(tokens, token_len, embedding)

    limits = limits or Limits()
    engine = StreamingEngine(encode, TorchEstimator(flow.estimator), n_feats=flow.config.n_feats,
                             meanflow=flow.config.meanflow, limits=limits)
    pieces, seams, latency, lo = [], [], [], 0
    for k, size in enumerate(chunks):
        inputs = {"speech_tokens": u.speech_tokens[lo:lo + size][None].astype(np.int64)}
        if k == 0:
            inputs.update(prompt_tokens=u.prompt_tokens[None].astype(np.int64),
                          prompt_mel=np.ascontiguousarray(u.prompt_mel.T)[None].astype(np.float32),
                          speaker_embedding=u.xvector[None].astype(np.float32),
                          seed=np.array([[seed]], dtype=np.int64))
            if n_steps is not None:
                inputs["n_timesteps"] = np.array([[n_steps]], dtype=np.int32)
        end = k == len(chunks) - 1
        req = parse_request(inputs, start=k == 0, end=end, limits=limits, n_feats=engine.n_feats)
        t0 = time.perf_counter()
        (res,) = engine.run([engine.admit(1, req)])
        latency.append(time.perf_counter() - t0)
        if k > 0 and res.mel.shape[1]:
            seams.append(res.frame_offset)
        pieces.append(res.mel)
        lo += size
    return Streamed(np.concatenate(pieces, axis=1), seams, latency, engine.solved_frames)


def stream_vs_offline(flow: S3Flow, utts: Sequence[HeldoutUtterance], name: str,
                      chunks_for=None, radius: int = 3, seed: int = 0,
                      n_steps: Optional[int] = None, limits: Optional[Limits] = None) -> StreamingComparison:
    """Stream each utterance with ``chunks_for(n_tokens)`` chunk sizes and compare with offline synthesis
    (same tokens, prompt and seed). Seam frames: within ``radius`` frames of a chunk boundary. Default
    ``limits``: the prefix re-run mode."""
    limits = limits or Limits(context_frames=-1)
    from s3flow_client import chunk_schedule
    chunks_for = chunks_for or (lambda n: chunk_schedule(n, 10, 2.0, 100))
    seam_err, other_err, gt_s, gt_o, n_seams = [], [], [], [], 0
    for k, u in enumerate(utts):
        got = stream_utterance(flow, u, chunks_for(len(u.speech_tokens)), seed=seed + k, n_steps=n_steps,
                               limits=limits)
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
