"""The files that ship beside the small model's checkpoints, so that evaluation, the demo and the tests
need neither the corpus nor espeak-ng.

* ``heldout.npz``: held-out sentences (never seen in training) as ``HeldoutUtterance``s: speech tokens, a
  prompt cut from other held-out utterances of the same voice, the x-vector, the ground-truth mel, the
  voice's mean spectrum, and the recording at 16 kHz (int16), the reference of every intelligibility
  figure (``s3flow_training.intelligibility``);
* ``demo_utt.npz``: the demo's ~5 s held-out sentence in ``scripts/flow_infer.py``'s and the client's
  ``--inputs`` format, with its ground-truth mel and recording;
* ``outside.npz``: the same for ``OUTSIDE_SENTENCES``, sentences outside the corpus' grammar and words;
* ``frontend.npz``: what turns a typed sentence into the small model's input (``Frontend``): the corpus'
  espeak-ng voices, its k-means codebook and per-voice statistics (the stand-in for T3 and its
  tokenizer), the x-vectors, and the settings of the audio preparation.

Example::

    utts = load_heldout("checkpoints/trained/heldout.npz")
    utts[0].reference        # (16000 * seconds,) float32
    fe = Frontend.load("checkpoints/trained/frontend.npz")
    tokens, mel, audio = fe.speak("Hello there.", voice=3)   # needs espeak-ng
"""
from __future__ import annotations

import ast
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from s3flow_contract.tensors import TOKENS_PER_SECOND
from s3flow.model.solver import FrameNoise
from s3flow_training.data import (VOICES, DataSettings, Dataset, Voice, audio_of, prepare_audio, prompt_for,
                                  synthesize, to_int16, tokenize)
from s3flow_training.intelligibility import RATE, to_16k
from s3flow_training.mel import S3GEN_MEL, log_mel

#: Held-out utterances shipped per voice (the rest of the held-out split stays in the corpus).
SHIPPED_PER_VOICE = 8
#: The demo utterance's target length in tokens (5 s).
DEMO_TOKENS = 125
#: Sentences outside the corpus' grammar and vocabulary (``outside.npz``): does the model speak what it was
#: never shown? Each is spoken by voice ``index % 8``.
OUTSIDE_SENTENCES = (
    "Please call Stella and ask her to bring these things with her from the store.",
    "The weather forecast predicts heavy rain over the northern mountains tonight.",
    "Could you send me the invoice before Friday afternoon?",
    "Seventy three passengers boarded the ferry to Copenhagen.",
    "My phone battery died while I was downloading the new software update.",
    "She plays the violin beautifully, although she never took lessons.",
    "Turn left at the second traffic light and park behind the pharmacy.",
    "Quantum computers might someday solve problems that seem impossible today.",
)


@dataclass
class HeldoutUtterance:
    """One held-out input: speech_tokens (N,), prompt_tokens (Np,), prompt_mel (n_feats, 2 Np)
    channels-major, xvector (192,), mel (n_feats, 2 N) the ground truth of the speech tokens;
    voice_mean (n_feats,) the voice's mean log-mel (a baseline); reference (16 kHz samples,) float32, the
    recording of the speech tokens (None where it was not kept)."""
    speech_tokens: np.ndarray
    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray
    xvector: np.ndarray
    mel: np.ndarray
    text: str = ""
    voice: int = -1
    voice_mean: Optional[np.ndarray] = None
    reference: Optional[np.ndarray] = None

    @property
    def frames(self) -> int:
        return int(self.mel.shape[1])


def heldout_utterances(ds: Dataset, indices: Optional[Sequence[int]] = None, seed: int = 0,
                       prompt_tokens: tuple[int, int] = (40, 60), corpus: Optional[Path] = None
                       ) -> list[HeldoutUtterance]:
    """Held-out entries of ``ds`` (default all) with a seeded prompt from other held-out utterances of the
    same voice (default 1.6 to 2.4 s), and their recordings at 16 kHz when ``corpus`` (the corpus' path,
    beside which the waveforms lie) is given."""
    rng = np.random.default_rng([seed, 30])
    out = []
    for i in (ds.split(heldout=True) if indices is None else indices):
        u = ds.utterances[i]
        pt, pm = prompt_for(ds, i, rng, *prompt_tokens)
        ref = to_16k(audio_of(corpus, ds, i), S3GEN_MEL.sampling_rate) if corpus is not None else None
        out.append(HeldoutUtterance(u.tokens.copy(), pt, pm, ds.xvectors[u.voice].copy(), u.mel.copy(),
                                    u.text, u.voice, ds.voice_stats[u.voice, 0].copy(), ref))
    return out


def save_heldout(path: str | Path, utts: Sequence[HeldoutUtterance]) -> Path:
    """Write utterances as padded arrays with lengths (numpy only, no pickles; recordings as int16)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = np.array([len(u.speech_tokens) for u in utts])
    npr = np.array([len(u.prompt_tokens) for u in utts])
    nref = np.array([len(u.reference) for u in utts])
    c = utts[0].mel.shape[0]
    st = np.zeros((len(utts), n.max()), np.int64)
    pt = np.zeros((len(utts), npr.max()), np.int64)
    pm = np.zeros((len(utts), c, 2 * npr.max()), np.float32)
    mel = np.zeros((len(utts), c, 2 * n.max()), np.float32)
    ref = np.zeros((len(utts), nref.max()), np.int16)
    for k, u in enumerate(utts):
        st[k, :n[k]], pt[k, :npr[k]] = u.speech_tokens, u.prompt_tokens
        pm[k, :, :2 * npr[k]], mel[k, :, :2 * n[k]] = u.prompt_mel, u.mel
        ref[k, :nref[k]] = to_int16(u.reference)
    np.savez_compressed(path, speech_tokens=st, speech_token_len=n, prompt_tokens=pt, prompt_token_len=npr,
                        prompt_mel=pm, xvector=np.stack([u.xvector for u in utts]).astype(np.float32),
                        mel=mel, text=np.array([u.text for u in utts]), voice=np.array([u.voice for u in utts]),
                        voice_mean=np.stack([u.voice_mean for u in utts]).astype(np.float32),
                        reference=ref, reference_len=nref, reference_rate=np.int64(RATE))
    return path


def load_heldout(path: str | Path) -> list[HeldoutUtterance]:
    with np.load(path, allow_pickle=False) as f:
        d = {k: f[k] for k in f.files}
    if int(d["reference_rate"]) != RATE:
        raise ValueError(f"{path}: recordings at {int(d['reference_rate'])} Hz, expected {RATE}")
    out = []
    for k, (n, npr) in enumerate(zip(d["speech_token_len"], d["prompt_token_len"])):
        out.append(HeldoutUtterance(d["speech_tokens"][k, :n].copy(), d["prompt_tokens"][k, :npr].copy(),
                                    d["prompt_mel"][k, :, :2 * npr].copy(), d["xvector"][k].copy(),
                                    d["mel"][k, :, :2 * n].copy(), str(d["text"][k]), int(d["voice"][k]),
                                    d["voice_mean"][k].copy(),
                                    d["reference"][k, :d["reference_len"][k]].astype(np.float32) / 32768.0))
    return out


def save_demo_input(path: str | Path, u: HeldoutUtterance, seed: int = 0, n_timesteps: int = 10) -> Path:
    """One utterance in ``scripts/flow_infer.py``'s input format (speech_tokens (1, N), prompt_tokens
    (1, Np), prompt_feat (1, 2 Np, n_feats) frames-major, embedding (1, 192), z = FrameNoise(seed) over
    prompt + speech, n_timesteps, finalize), which ``python -m s3flow_client --inputs`` also reads; plus
    ``mel`` (1, n_feats, 2 N), the ground truth, ``text``, ``voice`` and ``reference`` (16 kHz int16)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    c, tp = u.prompt_mel.shape
    z = FrameNoise(seed, c).full(tp, u.frames)
    np.savez(path, speech_tokens=u.speech_tokens[None].astype(np.int64),
             prompt_tokens=u.prompt_tokens[None].astype(np.int64),
             prompt_feat=np.ascontiguousarray(u.prompt_mel.T[None]).astype(np.float32),
             embedding=u.xvector[None].astype(np.float32), z=z[None].astype(np.float32),
             n_timesteps=np.int64(n_timesteps), finalize=np.bool_(True), mel=u.mel[None].astype(np.float32),
             text=np.array(u.text), voice=np.int64(u.voice), reference=to_int16(u.reference),
             reference_rate=np.int64(RATE))
    return path


def load_demo_input(path: str | Path) -> HeldoutUtterance:
    """The utterance of a ``save_demo_input`` file."""
    with np.load(path, allow_pickle=False) as d:
        return HeldoutUtterance(d["speech_tokens"][0], d["prompt_tokens"][0],
                                np.ascontiguousarray(d["prompt_feat"][0].T), d["embedding"][0], d["mel"][0],
                                str(d["text"]), int(d["voice"]), None,
                                d["reference"].astype(np.float32) / 32768.0)


# ---------------------------------------------------------------------------------------------------
# Text in: the corpus' front-end


@dataclass
class Frontend:
    """Typed text -> the small model's speech tokens, as the corpus made them (``Frontend.speak``)."""
    voices: tuple[Voice, ...]
    codebook: np.ndarray        # (K, 2 n_mels)
    voice_stats: np.ndarray     # (V, 2, n_mels)
    xvectors: np.ndarray        # (V, 192)
    settings: DataSettings

    @classmethod
    def of(cls, ds: Dataset) -> "Frontend":
        return cls(VOICES, ds.codebook, ds.voice_stats, ds.xvectors, ds.settings)

    def save(self, path: str | Path) -> Path:
        np.savez_compressed(path, codebook=self.codebook, voice_stats=self.voice_stats, xvectors=self.xvectors,
                            voices=np.array([repr(asdict(v)) for v in self.voices]),
                            settings=np.array(repr(asdict(self.settings))))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "Frontend":
        with np.load(path, allow_pickle=False) as d:
            voices = tuple(Voice(**ast.literal_eval(str(v))) for v in d["voices"])
            return cls(voices, d["codebook"], d["voice_stats"], d["xvectors"],
                       DataSettings(**ast.literal_eval(str(d["settings"]))))

    def speak(self, text: str, voice: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """espeak-ng speaks ``text`` in corpus voice ``voice``, prepared as the corpus' audio is; returns
        (tokens (N,), mel (n_mels, 2 N), audio (960 N,) at 24 kHz)."""
        if not 0 <= voice < len(self.voices):
            raise ValueError(f"voice must be in [0, {len(self.voices)}), got {voice}")
        with tempfile.TemporaryDirectory() as tmp:
            audio, rate = synthesize(text, self.voices[voice], tmp)
        y = prepare_audio(audio, rate, np.random.default_rng([seed, 5]), self.settings.noise_floor)
        mel = log_mel(torch.from_numpy(y)).numpy()
        return tokenize(mel, self.voice_stats[voice], self.codebook), mel, y


def pick_shipped(utts: Sequence[HeldoutUtterance], per_voice: int, demo_tokens: int) -> tuple[int, list[int]]:
    """The demo utterance (length closest to demo_tokens) and up to ``per_voice`` others of every voice."""
    demo = min(range(len(utts)), key=lambda k: abs(len(utts[k].speech_tokens) - demo_tokens))
    chosen, count = [], {}
    for k, u in enumerate(utts):
        if k != demo and count.get(u.voice, 0) < per_voice:
            chosen.append(k)
            count[u.voice] = count.get(u.voice, 0) + 1
    return demo, chosen


def outside_utterances(ds: Dataset, frontend: Frontend, seed: int = 0,
                       sentences: Sequence[str] = OUTSIDE_SENTENCES) -> list[HeldoutUtterance]:
    """``sentences`` spoken by the corpus' voices (espeak-ng) and tokenized by ``frontend``, each with a
    1.6-2.4 s prompt from the held-out utterances of its voice."""
    rng = np.random.default_rng([seed, 31])
    held = ds.split(heldout=True)
    out = []
    for k, text in enumerate(sentences):
        voice = k % len(frontend.voices)
        tokens, mel, audio = frontend.speak(text, voice, seed=k)
        anchor = next(i for i in held if ds.utterances[i].voice == voice)
        pt, pm = prompt_for(ds, anchor, rng, 40, 60)
        out.append(HeldoutUtterance(tokens, pt, pm, ds.xvectors[voice].copy(), mel.astype(np.float32), text, voice,
                                    ds.voice_stats[voice, 0].copy(), to_16k(audio, S3GEN_MEL.sampling_rate)))
    return out


def write_package(ds: Dataset, corpus: Path, out: Path, seed: int = 0, log=print) -> None:
    """heldout.npz, outside.npz, demo_utt.npz and frontend.npz into ``out`` (module docstring)."""
    utts = heldout_utterances(ds, seed=seed, corpus=corpus)
    demo, shipped = pick_shipped(utts, SHIPPED_PER_VOICE, DEMO_TOKENS)
    out.mkdir(parents=True, exist_ok=True)
    save_heldout(out / "heldout.npz", [utts[k] for k in shipped])
    save_demo_input(out / "demo_utt.npz", utts[demo], seed=0)
    frontend = Frontend.of(ds)
    frontend.save(out / "frontend.npz")
    save_heldout(out / "outside.npz", outside_utterances(ds, frontend, seed))
    log(f"wrote {out}/heldout.npz ({len(shipped)} utterances with recordings), outside.npz "
        f"({len(OUTSIDE_SENTENCES)} sentences outside the corpus), demo_utt.npz "
        f"({len(utts[demo].speech_tokens) / TOKENS_PER_SECOND:.1f} s: {utts[demo].text!r}), frontend.npz")
