"""Each instance's last report, for every process of the server: a board of fixed lanes in one shared-memory file,
opened once per process, written and read without a system call.

The solver and vocoder instances publish their load (``s3flow.serving.load.LoadReport``) and admission, the
vocoder and the solver read every instance's. They were a file per instance, replaced whole on each write and
read back by each reader: 6 to 7 of the 9 system calls a token2wav chunk still cost on the records (issue 49,
results/syscalls.md).

Layout. The file (``board`` in the record's per-server folder) holds ``LANES`` lanes of ``LANE_BYTES``. A lane is
one instance's, by name: ``name (64 bytes) | writer PID (i64) | version (u64) | length (u64) | crc32 (u32) | pad |
payload``. An instance claims its lane at its first write under the file's ``flock`` (the only system calls it
makes): the lane of its name (a stub reloaded under the server goes on in its predecessor's lane), else a free
one, else one whose writer died. A write is a sequence lock: the version made odd, the payload, its length and
checksum written, the version made even; a reader copies a lane whose version is even and unchanged across the
copy and whose checksum holds (the checksum keeps a torn copy out on a host whose stores may be seen out of order),
else keeps what it read last. Readers never write: a lane whose writer died is passed over, and a closed
instance's lane is emptied by the instance itself.

Example::

    board = ReportBoard(server_folder("load") / "board")
    board.write("cfm_solver_0", b'{"kind": "solver", ...}')
    board.read()        # {"cfm_solver_0": (pid, b'{"kind": ...}')}, every instance's
"""
from __future__ import annotations

import fcntl
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Optional

from s3flow.serving.records import map_region, writer_alive

LANES, LANE_BYTES = 16, 128 * 1024
MAGIC = 0x53334C4F41444231   # "S3LOADB1": this layout
_HEADER = struct.Struct("<QQQQ")            # magic, lanes, lane bytes, (unused)
_LANE = struct.Struct("<64sqQQII")          # name, writer pid, version, length, crc32, (pad)
_VERSION_AT = 72                            # the version's offset in a lane (name 64, pid 8)
PAYLOAD_BYTES = LANE_BYTES - _LANE.size
SIZE = _HEADER.size + LANES * LANE_BYTES
#: how many times a reader copies a lane that changed under it before it keeps its last copy
_TRIES = 3


class ReportBoard:
    """The board (module docstring). Thread-safe within a process."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._map, self._view = map_region(self.path, SIZE, (MAGIC, LANES, LANE_BYTES, 0), "reports")
        self._lanes: dict[str, int] = {}              # this process's: instance name -> its lane
        self._copies: dict[int, tuple] = {}           # lane -> (version, name, pid, payload) read last
        self._lock = threading.Lock()

    @staticmethod
    def _at(lane: int) -> int:
        return _HEADER.size + lane * LANE_BYTES

    # -- a writer: its own lane -------------------------------------------------------------------------
    def write(self, name: str, payload: bytes) -> None:
        """Replace instance ``name``'s report with ``payload``."""
        if len(payload) > PAYLOAD_BYTES:
            raise ValueError(f"a report holds at most {PAYLOAD_BYTES} bytes, got {len(payload)} ({name})")
        with self._lock:
            at = self._at(self._lane(name))
            version = struct.unpack_from("<Q", self._view, at + _VERSION_AT)[0]
            struct.pack_into("<Q", self._view, at + _VERSION_AT, version | 1)   # odd: being written
            self._view[at + _LANE.size:at + _LANE.size + len(payload)] = payload
            struct.pack_into("<QI", self._view, at + _VERSION_AT + 8, len(payload), zlib.crc32(payload))
            struct.pack_into("<Q", self._view, at + _VERSION_AT, (version | 1) + 1)

    def clear(self, name: str) -> None:
        """Instance ``name`` closes: its report is gone (the lane stays its name's)."""
        self.write(name, b"")

    def _lane(self, name: str) -> int:
        """The lane of instance ``name`` (module docstring), claimed under the file's lock at its first write."""
        if name in self._lanes:
            return self._lanes[name]
        key = name.encode()
        if not key or len(key) > 64:
            raise ValueError(f"an instance name is 1 to 64 bytes, got {name!r}")
        with open(self.path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)   # released when the file closes
            lanes = [_LANE.unpack_from(self._view, self._at(k)) for k in range(LANES)]
            names = [n.rstrip(b"\0") for n, *_ in lanes]
            mine = [k for k, n in enumerate(names) if n == key] or [k for k, n in enumerate(names) if not n] or \
                [k for k, (_, pid, *_) in enumerate(lanes) if not writer_alive(pid)]
            if not mine:
                raise RuntimeError(f"{self.path}: all {LANES} lanes hold a live instance's report")
            lane = mine[0]
            at = self._at(lane)
            struct.pack_into("<64sq", self._view, at, key, os.getpid())
        self._lanes[name] = lane
        return lane

    # -- readers: every lane ----------------------------------------------------------------------------
    def versions(self) -> tuple:
        """Every lane's version: unchanged, no report changed."""
        return tuple(struct.unpack_from("<Q", self._view, self._at(k) + _VERSION_AT)[0] for k in range(LANES))

    def read(self) -> dict[str, tuple[int, bytes]]:
        """Every instance's last whole report: name -> (writer PID, payload), empty ones (closed) left out."""
        out = {}
        with self._lock:
            for lane in range(LANES):
                copy = self._copy(lane)
                if copy is not None and copy[1] and copy[3]:
                    out[copy[1]] = (copy[2], copy[3])
        return out

    def _copy(self, lane: int) -> Optional[tuple]:
        """(version, name, pid, payload) of ``lane`` as last written whole; the last copy while it is written."""
        at = self._at(lane)
        last = self._copies.get(lane)
        for _ in range(_TRIES):
            version = struct.unpack_from("<Q", self._view, at + _VERSION_AT)[0]
            if last is not None and last[0] == version:
                return last
            if version & 1:
                continue
            raw_name, pid, _, length, crc, _ = _LANE.unpack_from(self._view, at)
            if length > PAYLOAD_BYTES:
                continue
            payload = bytes(self._view[at + _LANE.size:at + _LANE.size + length])
            if struct.unpack_from("<Q", self._view, at + _VERSION_AT)[0] != version or zlib.crc32(payload) != crc:
                continue
            last = (version, raw_name.rstrip(b"\0").decode(errors="replace"), pid, payload)
            self._copies[lane] = last
            return last
        return last

    def close(self) -> None:
        self._view.release()
        self._map.close()
