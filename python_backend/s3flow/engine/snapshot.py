"""Snapshots of a stream's state: what a resume on another server starts from, sealed against forgery.

In bounded context (``ChunkSolving.context_frames`` >= 0) a chunk depends only on the kept prompt, the last
frames' tokens and mel, which frames are final, and their starting noise (a function of seed and frame); the
vocoder's on its last frames and its source's phase (cumulative since the utterance began, so it cannot be
rebuilt from what a client received). The server hands that state to the client with every answer (the
``snapshot`` output); the client keeps the latest and sends it back with the START of a resume (the ``resume``
input), so a resume costs one chunk whatever the stream's age.

A snapshot is a run of **sections**, one per stateful model of the entry point: ``solver`` (``token2mel``'s whole
snapshot), then ``vocoder`` (``token2wav`` appends it). Each section is the model's state as a few numbers and
arrays (:func:`pack`), sealed with an HMAC-SHA256 keyed by the fleet's snapshot key (:class:`SnapshotKey`) over
the section's kind, the tenant (the solver's: a tenant cannot resume another's stream) and what it is bound to
(the vocoder's: the solver section it was made beside, so sections of two snapshots do not mix)::

    blob    = MAGIC section*
    section = len(kind) u8 | kind | len(payload) u32 | payload | mac[32]

A snapshot that comes back is untrusted input: its seal is checked before a byte of it is parsed, then its
shapes and ranges as any tensor's; the settings it was made under must be this server's, and the START it
comes with must carry the same prompt (its digest is in the solver's section). Every refusal is a
:class:`SnapshotError` naming what is wrong; a client then resumes by replaying the utterance.

Example::

    key = SnapshotKey(b"0123456789abcdef0123")
    blob = key.seal("solver", pack({"emitted": 100}, {"mel": mel}), tenant="acme")
    fields, arrays = unpack(key.open(blob, "solver", tenant="acme"))
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Mapping, Optional

import numpy as np

from s3flow.protocol import RequestError

MAGIC = b"S3FS1"
#: a whole snapshot is refused above this size before anything else is read
MAX_SNAPSHOT_BYTES = 4 << 20
_MAC_BYTES = 32
#: the dtypes a payload's arrays may have (nothing that numpy would unpickle)
_DTYPES = ("int16", "int64", "float32", "float64")


class SnapshotError(RequestError):
    """A snapshot that cannot be used here: malformed, forged, another tenant's, made under other settings, or for
    another prompt; or this server issues none (no key). The client should replay the utterance instead."""


# -- payloads: a few numbers and named arrays -------------------------------------------------------------
def pack(fields: Mapping[str, object], arrays: Mapping[str, np.ndarray]) -> bytes:
    """``fields`` (JSON numbers and strings) and ``arrays`` (dtypes of ``_DTYPES``) as one payload."""
    specs, blobs = [], []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        if a.dtype.name not in _DTYPES:
            raise TypeError(f"array {name}: dtype {a.dtype.name} is not one of {_DTYPES}")
        specs.append([name, a.dtype.name, list(a.shape)])
        blobs.append(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    header = json.dumps({"fields": dict(fields), "arrays": specs}, separators=(",", ":")).encode()
    return struct.pack("<I", len(header)) + header + b"".join(blobs)


def unpack(payload: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The fields and arrays of a payload made by :func:`pack` (SnapshotError when it is not one)."""
    try:
        (n,) = struct.unpack_from("<I", payload, 0)
        header = json.loads(payload[4:4 + n].decode())
        fields, specs = dict(header["fields"]), list(header["arrays"])
        arrays, at = {}, 4 + n
        for name, dtype, shape in specs:
            if dtype not in _DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"array {name}: {dtype} {shape}")
            dt = np.dtype(dtype).newbyteorder("<")
            size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if at + size > len(payload):
                raise ValueError(f"array {name} runs past the payload's end")
            arrays[str(name)] = np.frombuffer(payload, dt, size // dt.itemsize, at).reshape(shape).astype(dtype)
            at += size
        if at != len(payload):
            raise ValueError(f"{len(payload) - at} bytes after the last array")
    except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as exc:
        raise SnapshotError(f"snapshot payload is malformed ({exc})") from None
    return fields, arrays


# -- sections, sealed ----------------------------------------------------------------------------------
def sections(blob: bytes) -> list[tuple[str, bytes, bytes]]:
    """The (kind, payload, raw section bytes) of every section of ``blob``; SnapshotError when it is not a
    snapshot (the seals are not checked here)."""
    if len(blob) > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"snapshot holds {len(blob)} bytes, above {MAX_SNAPSHOT_BYTES}")
    if not blob.startswith(MAGIC):
        raise SnapshotError("resume is not an s3flow snapshot (send back the bytes of a 'snapshot' output as they "
                            "came)")
    out, at = [], len(MAGIC)
    while at < len(blob):
        start = at
        try:
            k = blob[at]
            kind = blob[at + 1:at + 1 + k].decode("ascii")
            (n,) = struct.unpack_from("<I", blob, at + 1 + k)
        except (IndexError, UnicodeDecodeError, struct.error):
            raise SnapshotError(f"snapshot is truncated or malformed at byte {at}") from None
        at += 1 + k + 4
        if at + n + _MAC_BYTES > len(blob):
            raise SnapshotError(f"snapshot section {kind!r} is truncated")
        out.append((kind, blob[at:at + n], blob[start:at + n + _MAC_BYTES]))
        at += n + _MAC_BYTES
    return out


def digest(*parts: bytes) -> str:
    """A hex SHA-256 over ``parts`` (what a section is bound to, a prompt's identity)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


class SnapshotKey:
    """Seals and opens sections with the fleet's snapshot key (every server that may resume a stream holds the
    same key: ``s3flow.serving.keys``)."""

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError(f"a snapshot key must be at least 16 bytes, got {len(key)}")
        self._key = hashlib.sha256(b"s3flow snapshot key\0" + key).digest()

    def _mac(self, kind: str, tenant: str, bound: bytes, payload: bytes) -> bytes:
        message = b"\0".join([MAGIC, kind.encode(), tenant.encode(), hashlib.sha256(bound).digest()]) + payload
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def seal(self, kind: str, payload: bytes, tenant: str = "", bound: bytes = b"", after: bytes = b"") -> bytes:
        """``after`` (a snapshot, or nothing) with one more section of ``kind``."""
        k = kind.encode("ascii")
        section = bytes([len(k)]) + k + struct.pack("<I", len(payload)) + payload
        return (after or MAGIC) + section + self._mac(kind, tenant, bound, payload)

    def open(self, blob: bytes, kind: str, tenant: str = "", bound: bytes = b"") -> bytes:
        """The payload of ``blob``'s section of ``kind``, once its seal holds; SnapshotError otherwise."""
        found = [(payload, raw) for k, payload, raw in sections(blob) if k == kind]
        if len(found) != 1:
            have = [k for k, _, _ in sections(blob)]
            raise SnapshotError(f"snapshot has no single '{kind}' section (it has {have}): it was made by "
                                f"another entry point")
        payload, raw = found[0]
        if not hmac.compare_digest(raw[-_MAC_BYTES:], self._mac(kind, tenant, bound, payload)):
            raise SnapshotError(f"snapshot's '{kind}' section does not carry this fleet's seal for this tenant "
                                f"(forged, altered, another tenant's, or sealed with another key)")
        return payload


def section_bytes(blob: bytes, kind: str) -> bytes:
    """The raw bytes of ``blob``'s section of ``kind`` (what a later section is bound to); b"" if none."""
    return next((raw for k, _, raw in sections(blob) if k == kind), b"")


def check_fields(fields: Mapping, expected: Mapping[str, object], what: str) -> None:
    """The settings a snapshot was made under must be these (a resume elsewhere would not equal the stream)."""
    differ = {k: (fields.get(k), v) for k, v in expected.items() if fields.get(k) != v}
    if differ:
        raise SnapshotError(f"{what} snapshot was made under other settings: " +
                            ", ".join(f"{k} {got!r} there, {want!r} here" for k, (got, want) in differ.items()))


def int_field(fields: Mapping, name: str, low: int = 0, high: Optional[int] = None) -> int:
    """An integer field within [low, high] (SnapshotError naming it otherwise)."""
    value = fields.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        raise SnapshotError(f"snapshot field {name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def array_field(arrays: Mapping[str, np.ndarray], name: str, dtype: str, shape: tuple) -> np.ndarray:
    """An array of this dtype and shape (-1: any length); SnapshotError naming it otherwise."""
    a = arrays.get(name)
    if a is None or a.dtype.name != dtype or a.ndim != len(shape) or any(
            want not in (-1, got) for want, got in zip(shape, a.shape)):
        got = None if a is None else f"{a.dtype.name} {list(a.shape)}"
        raise SnapshotError(f"snapshot array {name} must be {dtype} {list(shape)}, got {got}")
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise SnapshotError(f"snapshot array {name} holds NaN or Inf values")
    return a
