"""What the ``voice_encoder`` model does with one request, without Triton (unit-tested with no server).

A request is one of:

* ``wav`` (n,) float32 + ``sample_rate`` (1,) int32: a reference recording; its prompt is computed
  (``VoiceFrontend.embed``: upstream ``embed_ref``), stored in the registry, and returned with its id;
* ``prompt_tokens`` (Np,) + ``prompt_mel`` (2 Np, 80) + ``speaker_embedding`` (192,): a prompt made elsewhere
  (Chatterbox's ``conds.pt``: ``s3flow_client.voices.read_conds``; upstream's own front-end) is checked like a
  START's and stored;
* ``list_voices`` (1,) bool: the ids held, most recently used first.

Answers: ``voice_id`` (1,) bytes, ``prompt_tokens``, ``prompt_mel``, ``speaker_embedding`` (for a registration),
or ``voice_ids`` (k,) bytes. A bad request raises ``RequestError`` naming the bad value (INVALID_ARG).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from s3flow_contract.tensors import PROMPT
from s3flow.protocol import RequestError, RequestRules, parse_request
from s3flow.model.voice.frontend import VoiceFrontend
from s3flow.serving.voice_registry import VoiceRegistry


class VoiceService:
    def __init__(self, frontend: VoiceFrontend, registry: VoiceRegistry, rules: RequestRules = RequestRules(),
                 n_feats: int = 80):
        self.frontend, self.registry, self.rules, self.n_feats = frontend, registry, rules, n_feats

    def handle(self, inputs: Mapping[str, np.ndarray], tenant: str = "") -> dict[str, np.ndarray]:
        """One request of ``tenant`` (its voices only: docs/security.md)."""
        given = {k for k in inputs}
        if "list_voices" in given:
            if given - {"list_voices"}:
                raise RequestError(f"list_voices goes alone, got also {sorted(given - {'list_voices'})}")
            ids = [v.voice_id.encode() for v in self.registry.voices(tenant)]
            return {"voice_ids": np.array(ids, dtype=np.object_)}
        if "wav" in given or "sample_rate" in given:
            if given != {"wav", "sample_rate"}:
                raise RequestError(f"a reference needs exactly wav and sample_rate, got {sorted(given)}")
            prompt = self._embed(np.asarray(inputs["wav"]), np.asarray(inputs["sample_rate"]))
        elif given & set(PROMPT):
            prompt = {k: np.asarray(inputs[k]) for k in PROMPT if k in inputs}
            if given != set(PROMPT):
                raise RequestError(f"a prompt needs {list(PROMPT)} together, got {sorted(given)}")
        else:
            raise RequestError(f"nothing to do: send wav + sample_rate, the three prompt tensors, or list_voices; "
                               f"got {sorted(given)}")
        # the same checks a START request's prompt gets (vocabulary, 2 frames per token, NaN/Inf, sizes)
        req = parse_request({"speech_tokens": np.zeros((1, 1), np.int64), **{k: v[None] for k, v in prompt.items()}},
                            start=True, end=False, rules=self.rules, n_feats=self.n_feats)
        tokens, mel, emb = req.prompt_tokens, np.ascontiguousarray(req.prompt_mel.T), req.speaker_embedding
        voice_id = self.registry.put(tokens, mel, emb, tenant)
        return {"voice_id": np.array([voice_id.encode()], dtype=np.object_), "prompt_tokens": tokens,
                "prompt_mel": mel, "speaker_embedding": emb}

    def _embed(self, wav: np.ndarray, sample_rate: np.ndarray) -> dict[str, np.ndarray]:
        if sample_rate.size != 1 or sample_rate.dtype.kind not in "iu":
            raise RequestError(f"sample_rate must be one integer, got {sample_rate.dtype.name} shape "
                               f"{list(sample_rate.shape)}")
        try:
            prompt = self.frontend.embed(wav, int(sample_rate.reshape(-1)[0])).aligned()
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        return {"prompt_tokens": prompt.prompt_tokens[0], "prompt_mel": prompt.prompt_feat[0],
                "speaker_embedding": prompt.embedding[0]}
