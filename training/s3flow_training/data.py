"""A small speech corpus made on this machine: espeak-ng speech -> 24 kHz log-mel -> k-means tokens.

Pipeline (``build_dataset``), all seeded:

1. ``make_sentences``: a few hundred varied English sentences from a seeded template grammar
   (statements, questions, numbers, lists; 3 to ~20 words).
2. ``synthesize``: each sentence spoken by ``voices_per_sentence`` of the ``VOICES`` (espeak-ng voice
   variants with their own pitch and speed), read back from espeak-ng's 22.05 kHz WAV, resampled to
   24 kHz (``mel.resample``), a -86 dBFS seeded noise floor added (so silence is not one constant
   frame), and padded with silence to a whole number of tokens (960 samples = 2 mel frames).
3. ``mel.log_mel``: S3Gen's log-mel, 50 frames/s, 80 bins.
4. Speech tokens at 25/s: every pair of mel frames (160 values), standardised per voice, is assigned to
   the nearest of ``codebook_size`` k-means centroids learned on the training split (ids < 6561, as the
   real S3 vocabulary). Per-voice standardisation keeps the tokens mostly about *what* is said; *who*
   says it reaches the model through the x-vector and the prompt, as with real S3 tokens.
5. A 192-d x-vector stand-in per voice: a fixed seeded projection of the voice's standardised mean and
   standard deviation of log-mel over its training utterances.
6. Held-out split: ``heldout_fraction`` of the *sentences* (with all their voices) never reach training
   (neither the codebook nor the networks). Prompts (``prompt_for``) are cut from other utterances of the
   same voice, several joined end to end when a prompt is longer than one utterance (up to 10 s, as
   Chatterbox gives S3Gen).
7. The 24 kHz waveform of every utterance (int16, exactly 960 samples per token) beside the corpus
   (``<corpus>.audio.npy``, ``audio_of``): the vocoder's training targets and the intelligibility
   references.

Example::

    from s3flow_training.data import DataSettings, build_dataset
    ds = build_dataset(DataSettings(n_sentences=60), workdir="build/small_data")
    ds.utterances[0].tokens, ds.utterances[0].mel.shape   # (N,), (80, 2N)
    ds.save("build/small_data/dataset.npz")                # also writes dataset.npz.audio.npy
    audio_of("build/small_data/dataset.npz", ds, 0)          # (960 N,) float32 at 24 kHz
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from s3flow_client.audio import read_wav
from s3flow_contract.tensors import FRAMES_PER_SECOND
from s3flow_contract.tensors import TOKEN_MEL_RATIO as FRAMES_PER_TOKEN
from s3flow_training.mel import S3GEN_MEL, log_mel, resample

#: Audio samples per speech token at 24 kHz.
SAMPLES_PER_TOKEN = FRAMES_PER_TOKEN * S3GEN_MEL.hop_size
#: Width of the x-vector the flow encoder takes.
XVECTOR_DIM = 192
#: The real S3 tokenizer's vocabulary: every codebook id must stay below it.
VOCAB_SIZE = 6561


@dataclass(frozen=True)
class Voice:
    """An espeak-ng voice: ``-v name -p pitch -s speed`` (pitch 0-99, speed in words per minute)."""
    name: str
    pitch: int
    speed: int


VOICES: tuple[Voice, ...] = (
    Voice("en-us+m3", 45, 165),
    Voice("en-us+f2", 62, 150),
    Voice("en-gb+m1", 38, 172),
    Voice("en-gb+f4", 70, 158),
    Voice("en-gb-scotland+m7", 50, 155),
    Voice("en-029+f3", 56, 168),
    Voice("en-gb-x-rp+m5", 42, 145),
    Voice("en-us-nyc+f1", 66, 175),
)


@dataclass
class DataSettings:
    """Everything that decides the corpus; stored with it."""
    n_sentences: int = 1000
    voices_per_sentence: int = 3
    heldout_fraction: float = 0.1
    codebook_size: int = 512
    kmeans_iters: int = 30
    noise_floor: float = 5e-5
    max_seconds: float = 7.0
    seed: int = 0


@dataclass
class Utterance:
    """One spoken sentence: tokens (N,) int64, mel (80, 2N) float32, its voice and split; ``audio`` its
    24 kHz waveform (960 N,) int16 while the corpus is being made (``Dataset.load`` leaves it None:
    ``audio_of`` reads it from the file beside the corpus)."""
    text: str
    voice: int
    tokens: np.ndarray
    mel: np.ndarray
    heldout: bool
    audio: Optional[np.ndarray] = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class Dataset:
    """The corpus with its codebook, per-voice x-vectors and the settings that made it."""
    utterances: list[Utterance]
    codebook: np.ndarray          # (K, 2 * n_mels) in per-voice standardised units
    voice_stats: np.ndarray       # (V, 2, n_mels) per-voice mean and std of log-mel (training split)
    xvectors: np.ndarray          # (V, 192)
    settings: DataSettings = field(default_factory=DataSettings)

    def split(self, heldout: bool) -> list[int]:
        return [i for i, u in enumerate(self.utterances) if u.heldout == heldout]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lengths = np.array([u.n_tokens for u in self.utterances], dtype=np.int64)
        np.savez_compressed(
            path, tokens=np.concatenate([u.tokens for u in self.utterances]),
            mel=np.concatenate([u.mel for u in self.utterances], axis=1), lengths=lengths,
            voice=np.array([u.voice for u in self.utterances]),
            heldout=np.array([u.heldout for u in self.utterances]),
            text=np.array([u.text for u in self.utterances]), codebook=self.codebook,
            voice_stats=self.voice_stats, xvectors=self.xvectors,
            settings=np.array(repr(asdict(self.settings))))
        if all(u.audio is not None for u in self.utterances):
            np.save(audio_path(path), np.concatenate([u.audio for u in self.utterances]))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Dataset":
        with np.load(path, allow_pickle=False) as f:
            d = {k: f[k] for k in f.files}  # an NpzFile decompresses on every access: read each once
        ends = np.cumsum(d["lengths"])
        starts = ends - d["lengths"]
        utts = [Utterance(text=str(d["text"][i]), voice=int(d["voice"][i]),
                          tokens=d["tokens"][s:e].copy(), mel=d["mel"][:, 2 * s:2 * e].copy(),
                          heldout=bool(d["heldout"][i]))
                for i, (s, e) in enumerate(zip(starts, ends))]
        settings = DataSettings(**ast.literal_eval(str(d["settings"])))
        return cls(utts, d["codebook"], d["voice_stats"], d["xvectors"], settings)


def audio_path(corpus: str | Path) -> Path:
    """Where the corpus' waveforms live: ``<corpus>.audio.npy`` (int16, all utterances end to end)."""
    return Path(str(corpus) + ".audio.npy")


def audio_of(corpus: str | Path, ds: Dataset, index: int) -> np.ndarray:
    """Utterance ``index``'s 24 kHz waveform, (960 N,) float32 in [-1, 1] (memory-mapped read)."""
    start = SAMPLES_PER_TOKEN * sum(u.n_tokens for u in ds.utterances[:index])
    stop = start + SAMPLES_PER_TOKEN * ds.utterances[index].n_tokens
    audio = np.load(audio_path(corpus), mmap_mode="r")
    if audio.shape[0] != SAMPLES_PER_TOKEN * sum(u.n_tokens for u in ds.utterances):
        raise ValueError(f"{audio_path(corpus)} holds {audio.shape[0]} samples, not 960 per token of {corpus}")
    return np.asarray(audio[start:stop], dtype=np.float32) / 32768.0


def to_int16(audio: np.ndarray) -> np.ndarray:
    """float audio in [-1, 1] -> int16 (scaled by 32768 and clipped: ``audio_of`` inverts it)."""
    return np.clip(np.round(np.asarray(audio) * 32768.0), -32768, 32767).astype(np.int16)


# ---------------------------------------------------------------------------------------------------
# Sentences

_SUBJECTS = ["the old man", "my sister", "a small dog", "the teacher", "our neighbours", "the pilot",
             "a young farmer", "the children", "her brother", "the captain", "every student", "the baker",
             "a tired doctor", "the quiet girl", "my grandfather", "the new manager", "two painters",
             "the singer", "a clever fox", "the night guard", "your cousin", "the mayor", "a lost tourist",
             "the engineers", "a shy musician", "the fisherman", "my aunt", "the librarian", "a nervous actor",
             "the gardener", "our teacher's wife", "a sleepy cat", "the journalist", "my best friend",
             "the old sailor", "a patient nurse"]
_VERB_FORMS = [("paint", "painted"), ("carry", "carried"), ("find", "found"), ("open", "opened"),
               ("repair", "repaired"), ("watch", "watched"), ("clean", "cleaned"), ("sell", "sold"),
               ("build", "built"), ("forget", "forgot"), ("borrow", "borrowed"), ("describe", "described"),
               ("measure", "measured"), ("order", "ordered"), ("pack", "packed"), ("deliver", "delivered"),
               ("follow", "followed"), ("remember", "remembered"), ("photograph", "photographed"),
               ("return", "returned"), ("push", "pushed"), ("fix", "fixed"), ("lift", "lifted"),
               ("choose", "chose"), ("hide", "hid"), ("throw", "threw"), ("wash", "washed"), ("draw", "drew"),
               ("examine", "examined"), ("polish", "polished")]
_VERBS = [past for _, past in _VERB_FORMS]
_VERB_BASES = [base for base, _ in _VERB_FORMS]
_OBJECTS = ["the blue door", "a heavy box", "three letters", "the broken clock", "an old map",
            "the garden fence", "a basket of apples", "the kitchen window", "seven bottles", "the red bicycle",
            "a wooden chair", "the silver key", "a long rope", "the village church", "two warm blankets",
            "the morning paper", "a bag of flour", "the small boat", "the green lamp", "a pair of boots",
            "a jar of honey", "the yellow kite", "six thick books", "the dusty piano", "a cup of coffee",
            "the shiny trumpet", "a basket of eggs", "the leather jacket", "the frozen pond", "a pile of leaves",
            "the purple scarf", "a bunch of grapes"]
_PLACES = ["near the river", "in the market", "behind the station", "at the harbour", "under the bridge",
           "on the hill", "inside the museum", "by the lake", "across the street", "in the valley",
           "outside the school", "at the edge of the forest", "beside the fountain", "in the attic",
           "near the airport", "on the balcony", "through the tunnel", "in the old theatre"]
_TIMES = ["yesterday", "this morning", "last winter", "before the storm", "after lunch", "on Sunday",
          "at midnight", "every evening", "in the spring", "two days ago", "before sunrise", "later that night",
          "during the festival", "on Thursday", "in August", "after the concert", "just before dinner"]
_QUESTION_STARTS = ["why did", "when did", "where did", "how often did", "did"]
_ADJECTIVES = ["bright", "cold", "quiet", "busy", "strange", "gentle", "noisy", "empty", "warm", "narrow",
               "foggy", "huge", "smooth", "cheerful", "dark", "windy"]
_NOUNS = ["road", "room", "city", "sky", "house", "train", "field", "song", "story", "morning", "kitchen",
          "journey", "village", "meeting", "bridge", "evening"]
_NUMBERS = ["one", "four", "nine", "twelve", "fifteen", "twenty", "thirty six", "a hundred", "eighty two",
            "seventeen", "fifty", "three thousand"]


def make_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct sentences from a seeded template grammar (varied length and intonation)."""
    rng = np.random.default_rng([seed, 1])
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    out, seen = [], set()
    while len(out) < n:
        kind = int(rng.integers(7))
        if kind == 0:
            s = f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)}."
        elif kind == 1:
            s = f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)} {pick(_PLACES)} {pick(_TIMES)}."
        elif kind == 2:
            s = f"{pick(_QUESTION_STARTS)} {pick(_SUBJECTS)} {pick(_VERB_BASES)} {pick(_OBJECTS)}?"
        elif kind == 3:
            s = f"it was a {pick(_ADJECTIVES)} {pick(_NOUNS)}, and {pick(_SUBJECTS)} {pick(_VERBS)} " \
                f"{pick(_OBJECTS)} {pick(_PLACES)}."
        elif kind == 4:
            s = f"{pick(_TIMES)}, {pick(_NUMBERS)} people waited {pick(_PLACES)}."
        elif kind == 5:
            s = f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)}, {pick(_OBJECTS)} and {pick(_OBJECTS)}."
        else:
            a, b = rng.choice(len(_ADJECTIVES), 2, replace=False)
            s = f"{pick(_TIMES)} {pick(_SUBJECTS)} said that the {pick(_NOUNS)} was {_ADJECTIVES[a]} " \
                f"and {_ADJECTIVES[b]}."
        s = s[0].upper() + s[1:]
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


# ---------------------------------------------------------------------------------------------------
# Audio


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def synthesize(text: str, voice: Voice, tmpdir: str | Path) -> tuple[np.ndarray, int]:
    """espeak-ng speech for ``text`` as float32 at espeak's own rate (22050 Hz); (L,), and the rate."""
    wav = Path(tmpdir) / "utt.wav"
    subprocess.run(["espeak-ng", "-v", voice.name, "-p", str(voice.pitch), "-s", str(voice.speed),
                    "-w", str(wav), text], check=True, capture_output=True)
    audio, rate = read_wav(wav)
    if audio.ndim != 1:
        raise RuntimeError(f"espeak-ng wrote {audio.shape[1]} channels")
    return audio, rate


def prepare_audio(audio: np.ndarray, rate: int, rng: np.random.Generator, noise_floor: float) -> np.ndarray:
    """Resample to 24 kHz, add the noise floor, pad with silence to whole tokens (960 samples)."""
    y = resample(audio, rate, S3GEN_MEL.sampling_rate)
    pad = (-len(y)) % SAMPLES_PER_TOKEN + SAMPLES_PER_TOKEN  # at least one token of trailing silence
    y = np.concatenate([y, np.zeros(pad, np.float32)])
    y = y + noise_floor * rng.standard_normal(len(y)).astype(np.float32)
    return np.clip(y, -1.0, 1.0)


# ---------------------------------------------------------------------------------------------------
# Tokens and x-vectors


def token_features(mel: np.ndarray, stats: np.ndarray) -> np.ndarray:
    """(N, 2 * n_mels): frame pairs of ``mel`` (n_mels, 2N), standardised by the voice's (mean, std)."""
    z = (mel - stats[0][:, None]) / stats[1][:, None]
    return z.T.reshape(-1, 2 * z.shape[0])


def kmeans(x: np.ndarray, k: int, iters: int, seed: int, init_sample: int = 8192) -> np.ndarray:
    """Plain Lloyd k-means with k-means++ seeding on a random subsample; (k, D) float32 centroids."""
    rng = np.random.default_rng([seed, 4])
    sub = x[rng.choice(len(x), min(init_sample, len(x)), replace=False)].astype(np.float32)
    centers = np.empty((k, x.shape[1]), np.float32)
    centers[0] = sub[rng.integers(len(sub))]
    d2 = ((sub - centers[0]) ** 2).sum(1)
    for j in range(1, k):
        centers[j] = sub[rng.choice(len(sub), p=d2 / d2.sum())]
        d2 = np.minimum(d2, ((sub - centers[j]) ** 2).sum(1))
    xt, c = torch.from_numpy(x).float(), torch.from_numpy(centers)
    for _ in range(iters):
        assign = assign_tokens(xt, c)
        sums = torch.zeros_like(c).index_add_(0, assign, xt)
        counts = torch.bincount(assign, minlength=k).float()
        c = torch.where((counts == 0)[:, None], c, sums / counts.clamp(min=1)[:, None])
    return c.numpy().astype(np.float32)


def assign_tokens(x: torch.Tensor | np.ndarray, centers: torch.Tensor | np.ndarray) -> torch.Tensor:
    """(N,) int64 id of the nearest centroid for each row of x (N, D)."""
    x = torch.as_tensor(x).float()
    c = torch.as_tensor(centers).float()
    d = (x * x).sum(1, keepdim=True) - 2 * x @ c.T + (c * c).sum(1)[None]
    return d.argmin(1)


def tokenize(mel: np.ndarray, stats: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    """(N,) int64 speech tokens of a mel (n_mels, 2N) spoken by the voice of ``stats`` (2, n_mels): the
    corpus' stand-in for the S3 tokenizer."""
    return assign_tokens(token_features(mel, stats), codebook).numpy()


def make_xvectors(voice_stats: np.ndarray, seed: int) -> np.ndarray:
    """(V, 192) x-vector stand-ins: a fixed seeded Gaussian projection of each voice's mean and std of
    log-mel, standardised across voices (so the vectors differ in direction, which is what survives
    the encoder's L2 normalisation)."""
    feats = voice_stats.reshape(voice_stats.shape[0], -1).astype(np.float64)
    feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-6)
    proj = np.random.default_rng([seed, 3]).standard_normal((feats.shape[1], XVECTOR_DIM)) / np.sqrt(feats.shape[1])
    return (feats @ proj).astype(np.float32)


# ---------------------------------------------------------------------------------------------------


def build_dataset(settings: DataSettings = DataSettings(), log=print) -> Dataset:
    """Synthesise, featurise and tokenise the corpus (needs espeak-ng on PATH)."""
    if not espeak_available():
        raise RuntimeError("espeak-ng not found: apt-get install -y espeak-ng (or run `make train`)")
    s = settings
    rng = np.random.default_rng([s.seed, 2])
    sentences = make_sentences(s.n_sentences, s.seed)
    n_held = max(1, int(round(s.heldout_fraction * len(sentences))))
    held = set(rng.choice(len(sentences), n_held, replace=False).tolist())
    raw = []  # (text, voice, mel, heldout)
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(sentences):
            for v in rng.choice(len(VOICES), s.voices_per_sentence, replace=False).tolist():
                audio, rate = synthesize(text, VOICES[v], tmp)
                y = prepare_audio(audio, rate, rng, s.noise_floor)
                if len(y) > s.max_seconds * S3GEN_MEL.sampling_rate:
                    continue
                mel = log_mel(torch.from_numpy(y)).numpy()
                raw.append((text, v, mel, i in held, to_int16(y)))
    speech_s = sum(m.shape[1] for _, _, m, _, _ in raw) / FRAMES_PER_SECOND
    log(f"synthesised {len(raw)} utterances ({speech_s:.0f} s of speech) "
        f"with {len(VOICES)} voices")
    n_mels = S3GEN_MEL.num_mels
    stats = np.zeros((len(VOICES), 2, n_mels), np.float32)
    for v in range(len(VOICES)):
        frames = np.concatenate([m for _, vv, m, h, _ in raw if vv == v and not h], axis=1)
        stats[v, 0], stats[v, 1] = frames.mean(1), frames.std(1) + 1e-3
    train_feats = np.concatenate([token_features(m, stats[v]) for _, v, m, h, _ in raw if not h])
    codebook = kmeans(train_feats, s.codebook_size, s.kmeans_iters, s.seed)
    assert s.codebook_size <= VOCAB_SIZE
    utts = [Utterance(text=t, voice=v, tokens=tokenize(m, stats[v], codebook), mel=m.astype(np.float32),
                      heldout=h, audio=a) for t, v, m, h, a in raw]
    used = len(np.unique(np.concatenate([u.tokens for u in utts])))
    log(f"codebook: {s.codebook_size} centroids from {len(train_feats)} training tokens, {used} ids in use")
    return Dataset(utts, codebook, stats, make_xvectors(stats, s.seed), s)


def prompt_for(ds: Dataset, index: int, rng: np.random.Generator, min_tokens: int = 25,
               max_tokens: int = 75, same_split: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """A speaker prompt for utterance ``index``: a random stretch of other utterances of the same voice
    (of the same split when there are any), joined end to end in a random order until the prompt's
    length, drawn from [min_tokens, max_tokens], is reached (a 10 s prompt spans several sentences, as a
    reference recording would). Returns prompt tokens (Np,) and prompt mel (80, 2 Np)."""
    u = ds.utterances[index]
    others = [j for j, w in enumerate(ds.utterances) if w.voice == u.voice and j != index
              and (w.heldout == u.heldout or not same_split)]
    if not others:
        others = [j for j, w in enumerate(ds.utterances) if w.voice == u.voice and j != index]
    n = int(rng.integers(min_tokens, max_tokens + 1))
    tokens, mels, have = [], [], 0
    for j in rng.permutation(others):
        src = ds.utterances[int(j)]
        tokens.append(src.tokens)
        mels.append(src.mel)
        have += src.n_tokens
        if have >= n:
            break
    tok, mel = np.concatenate(tokens), np.concatenate(mels, axis=1)
    n = min(n, len(tok))
    a = int(rng.integers(0, len(tok) - n + 1))
    return tok[a:a + n].copy(), mel[:, 2 * a:2 * (a + n)].copy()
