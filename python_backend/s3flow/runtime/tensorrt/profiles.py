"""Optimisation profiles of the TensorRT engines: the (min, opt, max) of each input's batch and length axes.

One profile per engine, sized by the repository's longest inputs and batch size:

* estimator: batch 1 .. 2 x max batch (a guided batch of B utterances is one 2B call; a guidance rate of
  0 calls with B rows), frames 2 .. prompt + generated frames the server admits, opt at 2 x 300;
* flow encoder: batch 1 .. max batch, tokens 1 .. prompt + speech tokens admitted, opt at 150 tokens.

The inputs and their dims come from ``s3flow_contract.tensors`` (a ``-1`` first dim is the batch axis, any other
``-1`` the length axis, ``FEATS`` the mel bins).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from s3flow_contract import tensors as contract
from s3flow_contract.tensors import TOKEN_MEL_RATIO

MODELS = ("estimator", "flow_encoder")
#: The encoder's relative-position table (EncoderConfig.pos_enc_max_len default).
ENCODER_MAX_FRAMES = 6144


@dataclass(frozen=True)
class Profile:
    """One optimisation profile: (min, opt, max) of the batch axis and of the length axis.

    ``model`` is ``estimator`` (length = mel frames T) or ``flow_encoder`` (length = tokens N).
    """
    model: str
    batch: tuple[int, int, int]
    length: tuple[int, int, int]
    n_feats: int = 80
    meanflow: bool = False

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        for axis in ("batch", "length"):
            lo, opt, hi = getattr(self, axis)
            if not 1 <= lo <= opt <= hi:
                raise ValueError(f"{self.model} profile {axis} needs 1 <= min <= opt <= max, got {(lo, opt, hi)}")
        if self.model == "flow_encoder" and TOKEN_MEL_RATIO * self.length[2] > ENCODER_MAX_FRAMES:
            raise ValueError(f"flow_encoder profile max tokens {self.length[2]} exceeds the encoder's "
                             f"positional table ({ENCODER_MAX_FRAMES // TOKEN_MEL_RATIO} tokens)")

    def tensors(self) -> tuple[contract.Tensor, ...]:
        """The engine's inputs, in graph order (from the contract)."""
        if self.model == "estimator":
            return contract.estimator_inputs(self.meanflow)
        return contract.ENCODER_INPUTS

    def input_dims(self) -> dict[str, tuple]:
        """Input name -> dims with "B" for the batch and "L" for the length axis."""
        def dim(k: int, d):
            if d == -1:
                return "B" if k == 0 else "L"
            return self.n_feats if d == contract.FEATS else d
        return {t.name: tuple(dim(k, d) for k, d in enumerate(t.dims)) for t in self.tensors()}

    def input_shapes(self) -> dict[str, tuple[tuple, tuple, tuple]]:
        """Input name -> (min shape, opt shape, max shape)."""
        out = {}
        for name, dims in self.input_dims().items():
            out[name] = tuple(tuple(self.batch[k] if d == "B" else self.length[k] if d == "L" else d
                                    for d in dims) for k in range(3))
        return out

    def covers(self, batch: int, length: int) -> bool:
        return self.batch[0] <= batch <= self.batch[2] and self.length[0] <= length <= self.length[2]

    def tag(self) -> str:
        """Compact text of the ranges, e.g. ``b1-2-16_t2-300-4000`` (``n`` for the encoder's tokens)."""
        axis = "t" if self.model == "estimator" else "n"
        return f"b{'-'.join(map(str, self.batch))}_{axis}{'-'.join(map(str, self.length))}"


def max_frames(shapes: "ServedShapes") -> int:
    """Longest estimator input the server admits: prompt frames + generated frames."""
    return TOKEN_MEL_RATIO * shapes.max_prompt_tokens + shapes.max_utterance_frames


def max_tokens(shapes: "ServedShapes") -> int:
    """Longest encoder input the server admits: prompt tokens + speech tokens."""
    return shapes.max_prompt_tokens + shapes.max_utterance_frames // TOKEN_MEL_RATIO


def estimator_profile(n_feats: int, meanflow: bool, max_batch: int, max_frames: int, *,
                      min_frames: int = TOKEN_MEL_RATIO, opt_frames: int = 300,
                      opt_batch: Optional[int] = None) -> Profile:
    """Batch 1 .. 2 x max_batch (guided calls are 2B; meanflow calls are B), opt at one guided utterance."""
    hi = max_batch if meanflow else 2 * max_batch
    opt = opt_batch or (1 if meanflow else 2)
    return Profile("estimator", (1, min(opt, hi), hi),
                   (min_frames, min(max(opt_frames, min_frames), max_frames), max_frames), n_feats, meanflow)


def encoder_profile(max_batch: int, max_tokens: int, *, min_tokens: int = 1, opt_tokens: int = 150,
                    n_feats: int = 80) -> Profile:
    return Profile("flow_encoder", (1, 1, max_batch),
                   (min_tokens, min(max(opt_tokens, min_tokens), max_tokens), max_tokens), n_feats)


@dataclass
class ServedShapes:
    """What the engines' profiles need from a repository's ``cfm_solver`` config (scripts/build_engines.py
    reads it): batch size, the longest prompt and utterance it admits, mel bins, meanflow."""
    max_batch: int
    max_prompt_tokens: int
    max_utterance_frames: int
    n_feats: int
    meanflow: bool


def profiles_for(shapes: ServedShapes) -> dict[str, Profile]:
    """The two profiles a repository needs (sized by its longest inputs and batch size)."""
    return {"estimator": estimator_profile(shapes.n_feats, shapes.meanflow, shapes.max_batch, max_frames(shapes)),
            "flow_encoder": encoder_profile(shapes.max_batch, max_tokens(shapes), n_feats=shapes.n_feats)}
