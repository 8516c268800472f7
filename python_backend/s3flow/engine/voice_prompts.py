"""The prompt caches registered voices hold: a stream started by a voice id solves no prompt frames (issue 50).

With ``keep_solved`` 1 or 2 a stream's first chunk solves its prompt beside its new frames and keeps the prompt's
cache (``s3flow.engine.reuse``): every stream pays one prompt solve, and the cache depends on its seed and its first
chunk, so no two streams can share it. A stream started by a registered voice (``voice_cache_mb`` > 0) takes its
prompt's cache from a **prompt pass** instead: the capped prompt solved alone (its tokens encoded alone, its
starting point ``FrameNoise(PROMPT_PASS_SEED)``, the stream's step grid and guidance rate), keeping every prompt
frame. That cache is a function of the prompt, the steps and the guidance rate only, so the voice's later streams
read it from their first chunk on: the first stream by a voice pays one prompt pass, the rest none.

Its cost in quality (the prompt no longer attends to the first chunk's frames, the first chunk reads it as later
chunks do) is measured, paired, in results/stream_reuse_voice.md. The table is per solver instance, bounded by bytes,
least recently used out; keyed by the tenant, the prompt's digest (``solver_snapshot.prompt_digest``: the voice
id is a digest of the same tensors), the steps and the guidance rate. A snapshot says the stream's prompt came from
a prompt pass, so a resume (by voice id or with the prompt itself, on any server) makes the same cache and goes on
bit for bit.

Example::

    table = VoicePrompts(max_bytes=256 << 20)
    cache = table.get(key) or make_it()          # a StreamCache of the prompt's frames, one per Euler step
    table.put(key, cache)                        # False: larger than the whole table (not held)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional

from s3flow.engine.reuse import StreamCache

#: the prompt pass's noise seed: the prompt region's starting point, the same for every voice and server
PROMPT_PASS_SEED = 0


class VoicePrompts:
    """Prompt caches by key, at most ``max_bytes`` in all, the least recently used evicted first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._held: OrderedDict[Hashable, StreamCache] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._held)

    def get(self, key: Hashable) -> Optional[StreamCache]:
        cache = self._held.get(key)
        if cache is not None:
            self._held.move_to_end(key)
        return cache

    def put(self, key: Hashable, cache: StreamCache) -> bool:
        """Hold ``cache`` under ``key``, evicting the least recently used until it fits; False where it is larger
        than the whole table (not held: its stream still reads it)."""
        size = cache.nbytes()
        if size > self.max_bytes:
            return False
        old = self._held.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes()
        while self.nbytes + size > self.max_bytes:
            _, gone = self._held.popitem(last=False)
            self.nbytes -= gone.nbytes()
        self._held[key] = cache
        self.nbytes += size
        return True
