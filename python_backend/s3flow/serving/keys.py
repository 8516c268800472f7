"""The fleet's keys, each read from the file an environment variable names (a mounted Secret in Kubernetes).

* ``S3FLOW_VOICE_KEY_FILE``: keys the voice ids (``s3flow.serving.voice_registry``), so that an id names a voice
  only within its tenant;
* ``S3FLOW_SNAPSHOT_KEY_FILE``: seals the streams' snapshots (``s3flow.engine.snapshot``), so that a server takes
  back only what a server of the same fleet gave out. Unset, the voice key is used (under its own domain); with
  neither, the server gives no snapshots and takes none (its streams resume by replay).

Every server that may resume another's streams needs the same snapshot key. Each key is at least 16 bytes.

Example::

    S3FLOW_SNAPSHOT_KEY_FILE=/etc/s3flow/snapshot.key tritonserver ...
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from s3flow.engine.snapshot import SnapshotKey

VOICE_KEY_ENV = "S3FLOW_VOICE_KEY_FILE"
SNAPSHOT_KEY_ENV = "S3FLOW_SNAPSHOT_KEY_FILE"
MIN_KEY_BYTES = 16


def key_from_env(env: str) -> Optional[bytes]:
    """The key in the file ``$env`` names (None when the variable is unset); ValueError when it is too short."""
    path = os.environ.get(env)
    if not path:
        return None
    key = Path(path).read_bytes().strip()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{env}={path}: the key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key


def voice_key() -> Optional[bytes]:
    """The fleet's voice-id key (None when unset)."""
    return key_from_env(VOICE_KEY_ENV)


def snapshot_key() -> Optional[SnapshotKey]:
    """The fleet's snapshot key: its own, else the voice key's material, else None (no snapshots)."""
    own = key_from_env(SNAPSHOT_KEY_ENV)
    if own is not None:
        return SnapshotKey(own)
    voice = voice_key()
    return None if voice is None else SnapshotKey(b"from the voice key\0" + voice)
