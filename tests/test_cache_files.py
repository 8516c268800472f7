"""A stream's kept cache rows crossing once, as files (``s3flow.serving.cache_files``): the estimator's ``past``
built from the files is the solver's own packing bit for bit, each row is written once however many calls read
it, and a row's file goes when the solver lets the row go."""
from __future__ import annotations

import gc

import numpy as np
import torch

from s3flow.model.prefix_cache import CacheShape, PrefixCache
from s3flow.serving.cache_files import CacheReader, CacheWriter

SHAPE = CacheShape(layers=3, heads=2, head_dim=4, convs=5, width=6, tail=2)


def row(frames: int, seed: int) -> PrefixCache:
    g = torch.Generator().manual_seed(seed)
    s = SHAPE
    return PrefixCache(torch.randn(s.layers, 1, s.heads, frames, s.head_dim, generator=g),
                       torch.randn(s.layers, 1, s.heads, frames, s.head_dim, generator=g),
                       torch.randn(s.convs, 1, s.width, s.tail, generator=g), torch.ones(1, 1, frames))


def test_the_estimators_past_from_the_files_is_the_solvers_packing_bit_for_bit(tmp_path):
    rows = [row(7, 1), None, row(3, 2), row(7, 3)]   # rows of different lengths, one that reads none
    keep = torch.tensor([0, 2, 0, 5])
    writer = CacheWriter(SHAPE, tmp_path)
    got = CacheReader(SHAPE.parameter(), tmp_path).packed(writer.refs(rows), keep.numpy())
    want = SHAPE.pack_past(PrefixCache.stack(rows), keep).numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want)
    empty = CacheReader(SHAPE.parameter(), tmp_path).packed(writer.refs([None, None]), np.zeros(2, np.int64))
    stacked = PrefixCache.empty(SHAPE, 2, torch.zeros(1))
    assert np.array_equal(empty, SHAPE.pack_past(stacked, torch.zeros(2, dtype=torch.int64)).numpy())


def test_a_row_is_written_once_however_many_calls_read_it_and_goes_with_the_row(tmp_path):
    writer = CacheWriter(SHAPE, tmp_path)
    a, b = row(5, 1), row(5, 2)
    first = writer.refs([a, b])
    assert len(list(tmp_path.iterdir())) == 2
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    for _ in range(10):
        again = writer.refs([b, None, a])
        assert again.tolist() == [first[1].tolist(), [-1, -1], first[0].tolist()]
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps, "not written again"
    del a
    gc.collect()
    assert [p.name for p in tmp_path.iterdir()] == [f"{first[1][0]}-{first[1][1]}"], "a's file went with a"
    assert len(writer) == 1
    c = row(5, 3)   # a new row: a new file, never an old number again
    assert writer.refs([c])[0][1] > first[:, 1].max()
