"""How the client ends a gRPC stream (``s3flow_client.channel.ServerStream.close``): half-closed when nothing on it
awaits an answer, its call cancelled when the server has not ended it in time, cancelled at once otherwise.

Triton 2.51's gRPC frontend (the CPU server these tests run) could keep a cancelled stream's request when the
cancellation crossed that request's last response: its ensemble then never unloaded and the server's SIGTERM
waited its whole exit timeout (2 of 3 two-worker runs of test_faults and test_vocoder, before the client
half-closed). ``Run`` picks the way (tests/test_faults.py's hung-server test: half-closed after a full stream,
cancelled after a give-up); here the close itself, through tritonclient's own stream code over a stand-in call.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc._infer_stream import _InferStream

from s3flow_client.channel import Channel, ServerStream


class Cancelled(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "Locally cancelled by application!"


class StandInCall:
    """The response side of a gRPC stream call: no answers; it ends when the server ends the stream (``ends``
    after the client's half-close, or never: None) or when cancelled."""

    def __init__(self, stream: _InferStream, server_ends_after_s):
        self.stream, self.after_s = stream, server_ends_after_s
        self.ended, self.cancelled = threading.Event(), False

    def __iter__(self):
        return self

    def __next__(self):
        while not self.ended.is_set():
            if self.after_s is not None and self.stream._request_queue.qsize() and \
                    self.stream._request_queue.queue[-1] is None:   # the client half-closed: the server ends it
                time.sleep(self.after_s)
                self.ended.set()
            self.ended.wait(0.01)
        if self.cancelled:
            raise Cancelled()
        raise StopIteration

    def cancel(self):
        self.cancelled = True
        self.ended.set()

    def is_active(self):
        return not self.ended.is_set()


def open_stream(monkeypatch, server_ends_after_s) -> tuple[ServerStream, list]:
    """A ServerStream whose tritonclient client is real but for the call: ``start_stream`` gets a StandInCall."""
    calls = []

    def start_stream(self, callback, stream_timeout=None, headers=None, compression_algorithm=None):
        self._stream = _InferStream(callback, False)
        calls.append(StandInCall(self._stream, server_ends_after_s))
        self._stream._init_handler(calls[-1])

    monkeypatch.setattr(grpcclient.InferenceServerClient, "start_stream", start_stream)
    events = []
    stream = ServerStream(0, "127.0.0.1:1", events=type("Q", (), {"put": events.append})(), timeout_s=60,
                          header=1, channel=Channel())
    return stream, calls


def test_a_stream_with_nothing_awaited_is_half_closed_and_its_call_never_cancelled(monkeypatch):
    stream, [call] = open_stream(monkeypatch, server_ends_after_s=0.05)
    t0 = time.monotonic()
    stream.close(graceful=True, wait_s=5.0)
    assert not call.cancelled and call.ended.is_set() and not stream.alive
    assert stream.client._stream is None and time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("attempt", range(20))
def test_a_stream_the_server_keeps_open_has_its_call_cancelled_after_the_wait(monkeypatch, attempt):
    """The half-close stays the one caller of tritonclient's stop_stream (its close takes no lock: a second
    caller raced it to ``AttributeError`` once the wait ran out)."""
    stream, [call] = open_stream(monkeypatch, server_ends_after_s=None)
    t0 = time.monotonic()
    stream.close(graceful=True, wait_s=0.05)
    took = time.monotonic() - t0
    assert call.cancelled and stream.client._stream is None
    assert 0.05 <= took < 2.0, f"closed after {took:.2f} s"


def test_a_close_that_is_not_graceful_cancels_the_call_at_once(monkeypatch):
    stream, [call] = open_stream(monkeypatch, server_ends_after_s=None)
    t0 = time.monotonic()
    stream.close()
    assert call.cancelled and stream.client._stream is None and time.monotonic() - t0 < 1.0
