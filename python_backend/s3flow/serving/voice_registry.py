"""The voice registry: speaker prompts stored once under a voice id, looked up by START requests.

A voice is the three prompt tensors a START request would carry (``prompt_tokens`` (Np,), ``prompt_mel``
(2 Np, 80) frames-major, ``speaker_embedding`` (192,)). Its id is a digest of those tensors (``v-`` + 16 hex
digits), so the same reference gives the same id on every server and registering it twice stores it once.

Voices are files in one folder (``<id>.npz``, written atomically), shared by the processes of one server: the
``voice_encoder`` model writes them, the ``cfm_solver`` model reads them. The folder is

* the repository parameter ``voice_dir`` when set: voices survive restarts;
* otherwise ``/dev/shm/s3flow-voices-<server pid>``, made for this server run and removed when the
  ``voice_encoder`` model unloads, or by the next start once the server is gone (``s3flow.server.leftovers``):
  voices survive nothing.

Bounded by count (``max_voices``) and bytes (``max_voice_bytes``): registering beyond either evicts the least
recently used voices (a lookup counts as a use). An evicted id leaves a marker, so a later lookup says it was
evicted rather than unknown.

**Tenants** (docs/security.md): every call names a tenant ("" by default, the single tenant of a server
without them). Each tenant has its own space (a sub-folder; "" is the folder itself), so a tenant lists, uses
and evicts only its own voices, and the bounds are per tenant (a quota: one tenant cannot evict another's
voices). With a fleet ``secret`` (``S3FLOW_VOICE_KEY_FILE``) an id is a keyed digest (HMAC-SHA256) of the
tenant and the prompt: the same on every server that has the key, and not derivable from the reference audio
without it. Without a secret and tenant "", ids are the plain digest as before.

Example::

    registry = VoiceRegistry(folder, max_voices=1000, max_bytes=256 << 20)
    registry = VoiceRegistry.from_params(params)   # in a python model: its config's voice_* parameters
    voice_id = registry.put(prompt_tokens, prompt_mel, speaker_embedding)
    tensors = registry.get(voice_id)      # START-request tensors, batch first
"""
from __future__ import annotations

import hashlib
import hmac
import io
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from s3flow.protocol import RequestError
from s3flow.serving.records import server_folder, write_atomic
from s3flow.serving.config_params import Params
from s3flow.serving.keys import voice_key

_MARKERS_KEPT = 10000
#: a registry's bounds per tenant where its config does not say
MAX_VOICES, MAX_VOICE_BYTES = 1000, 256 << 20


class UnknownVoice(RequestError):
    """A START named a voice id this server does not hold (never registered here, or evicted)."""


def default_dir(server_pid: Optional[int] = None) -> Path:
    """The per-run folder of a server (``s3flow.serving.records.server_folder``: swept with the others once
    the server is gone, however it went)."""
    return server_folder("voices", server_pid)


def voice_id_of(prompt_tokens: np.ndarray, prompt_mel: np.ndarray, speaker_embedding: np.ndarray,
                tenant: str = "", secret: Optional[bytes] = None) -> str:
    digest = hashlib.sha256()
    for a in (prompt_tokens.astype(np.int64), prompt_mel.astype(np.float32), speaker_embedding.astype(np.float32)):
        digest.update(str(a.shape).encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    if secret is None and not tenant:
        return "v-" + digest.hexdigest()[:16]
    keyed = hmac.new(secret or b"", tenant.encode() + b"\0" + digest.digest(), hashlib.sha256)
    return "v-" + keyed.hexdigest()[:16]


@dataclass
class VoiceInfo:
    voice_id: str
    bytes: int
    last_used: float     # unix time


class VoiceRegistry:
    """Voices in ``folder``, per tenant at most ``max_voices`` of them and ``max_bytes`` in all (least recently
    used out); ids keyed with ``secret`` when given (module docstring)."""

    def __init__(self, folder, max_voices: int = MAX_VOICES, max_bytes: int = MAX_VOICE_BYTES,
                 secret: Optional[bytes] = None):
        if max_voices < 1 or max_bytes < 1:
            raise ValueError(f"max_voices and max_bytes must be >= 1, got {max_voices}, {max_bytes}")
        self.folder, self.max_voices, self.max_bytes = Path(folder), int(max_voices), int(max_bytes)
        self.secret = secret
        (self.folder / "evicted").mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_params(cls, params: Params) -> "VoiceRegistry":
        """The registry a python model's config names: ``voice_dir`` (empty: this server run's folder,
        :func:`default_dir`), ``max_voices`` and ``max_voice_bytes`` (the defaults above where absent), ids keyed
        with the fleet's voice key (``s3flow.serving.keys.voice_key``)."""
        return cls(params.str("voice_dir", "") or default_dir(), params.int("max_voices", MAX_VOICES),
                   params.int("max_voice_bytes", MAX_VOICE_BYTES), voice_key())

    def space(self, tenant: str = "") -> Path:
        """The tenant's folder ("" is the registry's own)."""
        if not tenant:
            return self.folder
        folder = self.folder / ("t-" + hashlib.sha256(tenant.encode()).hexdigest()[:16])
        (folder / "evicted").mkdir(parents=True, exist_ok=True)
        return folder

    def _path(self, voice_id: str, tenant: str = "") -> Path:
        if not (voice_id.startswith("v-") and len(voice_id) == 18 and all(c in "0123456789abcdef" for c in voice_id[2:])):
            raise UnknownVoice(f"voice_id {voice_id[:40]!r} is not a voice id (v- and 16 hex digits)")
        return self.space(tenant) / f"{voice_id}.npz"

    def put(self, prompt_tokens: np.ndarray, prompt_mel: np.ndarray, speaker_embedding: np.ndarray,
            tenant: str = "") -> str:
        """Store a voice (already validated) for ``tenant``; return its id. Evicts the tenant's least recently
        used voices if needed."""
        voice_id = voice_id_of(prompt_tokens, prompt_mel, speaker_embedding, tenant, self.secret)
        path = self._path(voice_id, tenant)
        if not path.exists():
            buf = io.BytesIO()
            np.savez(buf, prompt_tokens=prompt_tokens.astype(np.int64), prompt_mel=prompt_mel.astype(np.float32),
                     speaker_embedding=speaker_embedding.astype(np.float32))
            write_atomic(path, buf.getvalue())
        (path.parent / "evicted" / voice_id).unlink(missing_ok=True)
        os.utime(path)
        self._evict(keep=voice_id, tenant=tenant)
        return voice_id

    def get(self, voice_id: str, tenant: str = "") -> dict[str, np.ndarray]:
        """The START tensors of a voice of ``tenant`` (batch first), or UnknownVoice saying why it is not here
        (another tenant's voice is not here)."""
        path = self._path(voice_id, tenant)
        try:
            with np.load(path) as z:
                tensors = {k: z[k][None] for k in ("prompt_tokens", "prompt_mel", "speaker_embedding")}
        except FileNotFoundError:
            if (path.parent / "evicted" / voice_id).exists():
                raise UnknownVoice(f"voice_id {voice_id} was evicted (the registry keeps at most "
                                   f"{self.max_voices} voices and {self.max_bytes} bytes, least recently used "
                                   f"out): register the reference again") from None
            whose = f" for tenant {tenant!r}" if tenant else ""
            raise UnknownVoice(f"voice_id {voice_id} is not registered on this server{whose}: register the "
                               f"reference (the voice_encoder model) first") from None
        try:
            os.utime(path)
        except FileNotFoundError:  # evicted a moment ago: the tensors are read already
            pass
        return tensors

    def voices(self, tenant: str = "") -> list[VoiceInfo]:
        """The tenant's voices, most recently used first (from the files' sizes and times: nothing is read)."""
        out = []
        for p in self.space(tenant).glob("v-*.npz"):
            try:
                st = p.stat()
            except OSError:  # evicted meanwhile
                continue
            out.append(VoiceInfo(p.stem, st.st_size, st.st_mtime))
        return sorted(out, key=lambda v: -v.last_used)

    def _evict(self, keep: str, tenant: str = "") -> None:
        folder = self.space(tenant)
        held = sorted(self.voices(tenant), key=lambda v: v.last_used)  # least recently used first
        total = sum(v.bytes for v in held)
        while held and (len(held) > self.max_voices or total > self.max_bytes):
            victim = held.pop(0)
            if victim.voice_id == keep and held:  # the voice just registered goes last
                held.append(victim)
                continue
            (folder / f"{victim.voice_id}.npz").unlink(missing_ok=True)
            (folder / "evicted" / victim.voice_id).write_text(f"{time.time():.0f}\n")
            total -= victim.bytes
            if victim.voice_id == keep:
                break
        markers = sorted((folder / "evicted").iterdir(), key=lambda p: p.stat().st_mtime)
        for p in markers[:max(0, len(markers) - _MARKERS_KEPT)]:
            p.unlink(missing_ok=True)

