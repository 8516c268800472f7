"""A stream's kept prefix cache, written once where every estimator instance reads it (issue 50).

With the prompt kept (``keep_solved 1``) every estimator call of a stream reads the same cache rows (one per Euler
step and guidance half), and over BLS each call carried them again: about 0.6 MB a call on the small teacher, 23 MB
at full size, at about 1.1 ms per MB (results/bls_cost.md), which was the whole of what keeping the prompt added to
a chunk's fixed cost. So the solver writes each row once into a file of the server's ``caches`` folder
(``s3flow.serving.records``: ``/dev/shm/s3flow-caches-<server pid>``), named by its process and a number, and a call
carries, per estimator row, that name (``past_rows``: (pid, number), or (-1, -1) for a row that reads none) and
what the row keeps (``keep``); the estimator instance (any of them: Triton picks one per call) reads the rows,
stacks them and packs the cached graph's one ``past`` input itself, exactly as ``CacheShape.pack_past`` of
``PrefixCache.stack`` does in the solver (tests/test_cache_files.py).

A row's file lives as long as the row: :class:`CacheWriter` writes it the first time a call reads the row and
removes it when the solver lets the row go (a ``weakref.finalize``: the stream ended, was dropped, or its cache
was replaced); the folder goes with the server (``s3flow.server.leftovers``). A file holds one row of P frames as
``CacheShape.pack_kept`` lays it out (keys, values, convolution tails, key mask), so its size says P.

The reader imports no torch (the estimator's stub on a CPU host runs ONNX Runtime and numpy only): it takes the
cache's six numbers as the ``estimator_cache`` parameter writes them (``CacheShape.parameter``).

Example::

    writer = CacheWriter(shape)                                   # the solver (shape: its CacheShape)
    refs = writer.refs(rows)                                      # (B, 2) int64: each row's file, written if new
    past = CacheReader(shape.parameter()).packed(refs, keep)      # the estimator: the graph's flat ``past``
"""
from __future__ import annotations

import mmap
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from s3flow.serving.records import server_folder

if TYPE_CHECKING:
    from s3flow.model.prefix_cache import CacheShape, PrefixCache

#: the record's name (``s3flow.serving.records.RECORDS``)
RECORD = "caches"
#: a row that reads no cache
NO_ROW = (-1, -1)


def default_folder(server_pid: Optional[int] = None) -> Path:
    """This server's folder of cache rows (the models' parent's by default)."""
    return server_folder(RECORD, server_pid)


def row_file(folder: Path, pid: int, number: int) -> Path:
    return folder / f"{pid}-{number}"


class CacheWriter:
    """The solver's side: each cache row (a one-row ``PrefixCache``) in a file of its own, written once."""

    def __init__(self, shape: "CacheShape", folder: Optional[Path] = None):
        self.shape = shape
        self.folder = Path(folder) if folder is not None else default_folder()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()
        self._numbers = 0
        self._written: dict[int, tuple[int, weakref.ref]] = {}   # id(row) -> (its file's number, the row)

    def __len__(self) -> int:
        return len(self._written)

    def refs(self, rows: Sequence[Optional["PrefixCache"]]) -> np.ndarray:
        """(len(rows), 2) int64: each row's (pid, number), its file written if it is new; (-1, -1) for None."""
        out = np.full((len(rows), 2), -1, np.int64)
        for i, row in enumerate(rows):
            if row is not None:
                out[i] = (self.pid, self._number(row))
        return out

    def _number(self, row: "PrefixCache") -> int:
        known = self._written.get(id(row))
        if known is not None and known[1]() is row:
            return known[0]
        self._numbers += 1
        number, path = self._numbers, row_file(self.folder, self.pid, self._numbers)
        flat = self.shape.pack_kept(row).detach().cpu().numpy().astype(np.float32, copy=False)
        with open(path, "wb") as f:
            f.write(flat.tobytes())
        key = id(row)
        self._written[key] = (number, weakref.ref(row))
        weakref.finalize(row, self._forget, key, number, path)
        return number

    def _forget(self, key: int, number: int, path: Path) -> None:
        if self._written.get(key, (None,))[0] == number:
            del self._written[key]
        try:
            path.unlink()
        except FileNotFoundError:
            pass


class CacheReader:
    """The estimator's side: the rows a call names, stacked and packed as the cached graph's ``past`` input."""

    def __init__(self, shape: str, folder: Optional[Path] = None):
        """``shape``: the cache's six numbers, comma-separated (layers, heads, head_dim, convs, width, tail)."""
        numbers = [int(v) for v in shape.split(",")]
        if len(numbers) != 6 or min(numbers) < 1:
            raise ValueError(f"a cache shape is six positive numbers, got {shape!r}")
        self.layers, self.heads, self.head_dim, self.convs, self.width, self.tail = numbers
        self.folder = Path(folder) if folder is not None else default_folder()
        self._tail = self.convs * self.width * self.tail
        self._per_frame = 2 * self.layers * self.heads * self.head_dim + 1

    def packed(self, refs: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """``CacheShape.pack_past(PrefixCache.stack(rows), keep)`` of the rows ``refs`` names, as float32 (every
        row padded to the longest, at least one frame; a row that reads none: masked keys, zero tails)."""
        s, b = self, len(refs)
        rows = [None if int(p) < 0 else self._read(int(p), int(n)) for p, n in refs]
        longest = max([1] + [frames for frames, _ in filter(None, rows)])
        keys = np.zeros((s.layers, b, s.heads, longest, s.head_dim), np.float32)
        values = np.zeros_like(keys)
        convs = np.zeros((s.convs, b, s.width, s.tail), np.float32)
        mask = np.zeros((b, 1, longest), np.float32)
        for i, row in enumerate(rows):
            if row is None:
                continue
            p, flat = row
            kv = s.layers * s.heads * p * s.head_dim
            keys[:, i, :, :p] = flat[:kv].reshape(s.layers, s.heads, p, s.head_dim)
            values[:, i, :, :p] = flat[kv:2 * kv].reshape(s.layers, s.heads, p, s.head_dim)
            convs[:, i] = flat[2 * kv:2 * kv + self._tail].reshape(s.convs, s.width, s.tail)
            mask[i, 0, :p] = flat[2 * kv + self._tail:2 * kv + self._tail + p]
        return np.concatenate([keys.reshape(-1), values.reshape(-1), convs.reshape(-1), mask.reshape(-1),
                               np.asarray(keep, np.float32).reshape(-1)])

    def _read(self, pid: int, number: int) -> tuple[int, np.ndarray]:
        """(P, the row's floats) from its file (a copy: the file may go once the call is answered)."""
        path = row_file(self.folder, pid, number)
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                flat = np.frombuffer(m, np.float32).copy()
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"cache row {pid}-{number} is not in {self.folder}: {exc}") from None
        frames, extra = divmod(flat.size - self._tail, self._per_frame)
        if extra or frames < 1:
            raise ValueError(f"cache row {pid}-{number} holds {flat.size} floats: not a row of this cache's shape")
        return frames, flat
