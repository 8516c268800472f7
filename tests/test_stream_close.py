"""How the client ends a gRPC stream (``s3flow_client.channel.ServerStream.close``): half-closed when nothing on it
awaits an answer, cancelled when something does or when the server does not end it in time.

Triton 2.51's gRPC frontend (the CPU server these tests run) could keep a cancelled stream's request when the
cancellation crossed that request's last response: its ensemble then never unloaded and the server's SIGTERM
waited its whole exit timeout (2 of 3 two-worker runs of test_faults and test_vocoder, before the client
half-closed). The served side is checked in tests/test_faults.py (a finished stream half-closed, a hung one
cancelled); here the close itself, over a stand-in for tritonclient's stream calls.
"""
from __future__ import annotations

import threading
import time

import pytest

from s3flow_client.channel import Channel, ServerStream


class StandIn:
    """tritonclient's InferenceServerClient as far as ServerStream uses it; a graceful stop_stream() returns
    once the server ends the stream (``ends``), as tritonclient's blocks until then."""

    def __init__(self, server_ends_after_s: float):
        self.ends = threading.Event()
        self.after_s, self.calls = server_ends_after_s, []

    def start_stream(self, callback, stream_timeout, headers):
        self.calls.append("start")

    def stop_stream(self, cancel_requests=False):
        self.calls.append("cancel" if cancel_requests else "half-close")
        if cancel_requests:
            self.ends.set()
        else:
            self.ends.wait(self.after_s)   # the server ends it then, or a cancel does first

    def close(self):
        self.calls.append("close")


@pytest.fixture
def stand_in(monkeypatch):
    made = []

    def connect(self, url):
        made.append(StandIn(made_after_s.pop(0)))
        return made[-1]

    made_after_s: list = []
    monkeypatch.setattr(Channel, "connect", connect)
    return made, made_after_s


def open_stream(stand_in, server_ends_after_s: float) -> tuple[ServerStream, StandIn]:
    made, after = stand_in
    after.append(server_ends_after_s)
    stream = ServerStream(0, "127.0.0.1:1", events=None, timeout_s=60, header=1, channel=Channel())
    return stream, made[-1]


def test_a_stream_with_nothing_awaited_is_half_closed_and_never_cancelled(stand_in):
    stream, client = open_stream(stand_in, server_ends_after_s=0.05)
    t0 = time.monotonic()
    stream.close(graceful=True, wait_s=5.0)
    assert client.calls == ["start", "half-close", "close"] and not stream.alive
    assert time.monotonic() - t0 < 2.0


def test_a_stream_the_server_does_not_end_in_time_is_cancelled_after_the_wait(stand_in):
    stream, client = open_stream(stand_in, server_ends_after_s=3600)
    t0 = time.monotonic()
    stream.close(graceful=True, wait_s=0.3)
    took = time.monotonic() - t0
    assert client.calls == ["start", "half-close", "cancel", "close"]
    assert 0.3 <= took < 2.0, f"closed after {took:.2f} s"


def test_a_stream_with_answers_awaited_is_cancelled_at_once(stand_in):
    stream, client = open_stream(stand_in, server_ends_after_s=3600)
    t0 = time.monotonic()
    stream.close()
    assert client.calls == ["start", "cancel", "close"] and time.monotonic() - t0 < 1.0

