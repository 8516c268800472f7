"""One vocoder instance without a server (``s3flow.serving.vocoder_instance``): when its load report says it was
last free. The solver reads it (``s3flow.serving.arrivals.Delivery``) to tell an answer still queued for the vocoder
from one dropped on its way: a vocoder running batch after batch is free between them with answers still queued."""
from __future__ import annotations

import time

import pytest

from test_solver_instance import Slots, records  # noqa: F401 (fixtures)
from test_vocoder_session import Flaky, runner
from s3flow.engine.vocoder_stream import StreamSettings, VocoderStream
from s3flow.serving.config_params import Params
from s3flow.serving import vocoder_instance
from s3flow.serving.vocoder_instance import VocoderInstance


@pytest.fixture
def vocoder(records):
    networks = Flaky()
    stream = VocoderStream(networks.f0, networks.decode, runner().hift.source_params, StreamSettings(), n_feats=80)
    params = Params({"parameters": {"warmup": {"string_value": "false"}}}, "vocoder")
    v = VocoderInstance(params, "vocoder", "vocoder_0", stream, lambda *a: None, Slots(), max_batch=2)
    yield v
    v.close()


def test_a_vocoder_is_free_only_once_a_batch_took_everything_queued(vocoder, monkeypatch):
    monkeypatch.setattr(vocoder_instance, "DISPATCH_S", 30.0)   # (no host stall may count as an idle spell)
    first, during = time.time(), []
    for _ in range(2):   # full batches: more may be queued behind them
        vocoder.batch(lambda: during.append(vocoder.free_at()) or [], count=2)
        assert vocoder.free_at() < first, "between full batches, answers may still wait in Triton's queue"
    assert all(at < first for at in during)
    began = time.time()
    vocoder.batch(lambda: during.append(vocoder.free_at()) or [], count=1)   # less than its max: took all queued
    assert began <= during[-1] == vocoder.free_at() < time.time(), "free since that batch began, not since its end"
    monkeypatch.setattr(vocoder_instance, "DISPATCH_S", 0.05)
    time.sleep(0.1)
    assert time.time() - vocoder.free_at() < 0.05, "without a batch for a while: free now"
