"""One utterance streamed in process through the solver's session, chunk by chunk as a client sends it.

The driver the small model's evaluation (``s3flow_training.evaluate``) and the benchmark (``scripts/benchmark.py``)
run the served code path with: the same ``SolverSession.handle`` that ``cfm_solver`` calls, with no server.

Example::

    session = SolverSession(engine, RequestRules())
    got = stream_in_process(session, speech_tokens, [10, 20, 40], prompt_tokens=p_tokens, prompt_mel=p_mel,
                            speaker_embedding=xvector, seed=0)
    got.mel, got.seams, got.latencies_s
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from s3flow_contract.tensors import request_arrays
from s3flow.serving.incoming import Incoming
from s3flow.serving.session import SolverSession


@dataclass
class LocalStream:
    """One utterance streamed in process: each chunk's result and its latency (seconds in ``handle``)."""
    results: list
    latencies_s: list

    @property
    def mel(self) -> np.ndarray:
        """(n_feats, frames): the chunks' mel end to end."""
        return np.concatenate([r.mel for r in self.results], axis=1)

    @property
    def seams(self) -> list[int]:
        """Frame offsets where chunks 2, 3, ... began (those that brought frames)."""
        return [r.frame_offset for r in self.results[1:] if r.mel.shape[1]]


def stream_in_process(session: SolverSession, speech_tokens: np.ndarray, chunks, *, corr_id=1, end: bool = True,
                      **start) -> LocalStream:
    """Stream one utterance chunk by chunk through ``session`` as a client would: the START carries ``start``
    (the keywords of ``s3flow_contract.tensors.request_arrays``: prompt_tokens, prompt_mel frames-major,
    speaker_embedding, seed, n_timesteps, guidance_rate, voice_id); the last chunk is the END unless ``end`` is
    False (the sequence then stays live: ``session.cancel`` ends it). Raises RuntimeError naming the chunk on an
    error answer."""
    results, latencies, lo = [], [], 0
    for k, size in enumerate(chunks):
        inputs = request_arrays(speech_tokens[lo:lo + size], start=k == 0, **(start if k == 0 else {}))
        last = end and k == len(chunks) - 1
        t0 = time.perf_counter()
        [outcome] = session.handle([Incoming(corr_id=corr_id, start=k == 0, end=last, inputs=inputs)])
        latencies.append(time.perf_counter() - t0)
        if outcome.error is not None:
            raise RuntimeError(f"chunk {k} ({size} tokens) was refused: {outcome.error}")
        results.append(outcome.result)
        lo += size
    return LocalStream(results, latencies)
