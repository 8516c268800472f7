"""How the client reaches a server: TLS and the gRPC metadata every call carries; one stream to one server.

A plain loopback server needs nothing (``Channel()``). A server or router that terminates TLS needs the CA
that signed its certificate (``root_certificates``); with mutual TLS also the client's own key and
certificate chain. ``headers`` go with every call and stream: a tenant's credentials where a router
authenticates them, or the admin key of Triton's restricted API categories (docs/security.md).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import tritonclient.grpc as grpcclient

from .wire import infer_inputs, requested_outputs

#: gRPC metadata naming the stream's first sequence id: a load balancer hashing on it (docker/k8s/) keeps
#: every chunk of the stream's utterances on one server, which sequence batching requires.
SEQUENCE_HEADER = "x-sequence-id"


@dataclass(frozen=True)
class Channel:
    root_certificates: Optional[Path] = None  #: PEM CA bundle the server's certificate must chain to
    private_key: Optional[Path] = None        #: PEM key of the client certificate (mutual TLS)
    certificate_chain: Optional[Path] = None  #: PEM client certificate chain (mutual TLS)
    headers: dict = field(default_factory=dict)

    def __post_init__(self):
        if (self.private_key is None) != (self.certificate_chain is None):
            raise ValueError("mutual TLS needs both private_key and certificate_chain "
                             f"(got private_key={self.private_key}, certificate_chain={self.certificate_chain})")
        for what in ("root_certificates", "private_key", "certificate_chain"):
            path = getattr(self, what)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{what}={path}: no such file")

    @property
    def tls(self) -> bool:
        return self.root_certificates is not None or self.private_key is not None

    def connect(self, url: str) -> grpcclient.InferenceServerClient:
        """A gRPC client of ``url`` over this channel (TLS when any certificate is set)."""
        if not self.tls:
            return grpcclient.InferenceServerClient(url)
        read = lambda p: None if p is None else str(p)  # noqa: E731  (tritonclient takes file names)
        return grpcclient.InferenceServerClient(url, ssl=True, root_certificates=read(self.root_certificates),
                                                private_key=read(self.private_key),
                                                certificate_chain=read(self.certificate_chain))


class ServerStream:
    """One gRPC stream to one server; its callbacks land in the shared event queue tagged with its id."""

    def __init__(self, conn_id: int, url: str, events: queue.Queue, timeout_s: float, header: int,
                 channel: Channel):
        self.id, self.url, self.alive = conn_id, url, True
        self.client = channel.connect(url)
        self.client.start_stream(callback=lambda result, error: events.put((conn_id, result, error)),
                                 stream_timeout=timeout_s, headers={**channel.headers, SEQUENCE_HEADER: str(header)})

    def send(self, model: str, tensors: dict, request_id: str, corr_id: int, start: bool, end: bool,
             outputs: tuple) -> None:
        self.client.async_stream_infer(model, infer_inputs(tensors), request_id=request_id, sequence_id=corr_id,
                                       sequence_start=start, sequence_end=end, outputs=requested_outputs(outputs))

    def close(self, graceful: bool = False, wait_s: float = 5.0) -> None:
        """End the stream. ``graceful`` (nothing is awaited on it): half-close it, as a plain tritonclient
        ``stop_stream()`` does, and let the server end it; a server that has not within ``wait_s`` has the call
        cancelled. Otherwise cancel at once: the requests still in flight are given up.

        Why not always cancel: Triton 2.51's gRPC frontend (the CPU server here; fixed in 2.57) could leave a
        cancelled stream's request unreleased when the cancellation crossed that request's last response on its
        way out: the ensemble it named then never unloaded, and the server's SIGTERM waited its whole exit timeout
        and ended in SIGKILL (seen in 2 of 3 two-worker runs of tests/test_faults.py and tests/test_vocoder.py)."""
        self.alive = False
        if not graceful:
            try:
                self.client.stop_stream(cancel_requests=True)  # joins the response thread
            finally:
                self.client.close()
            return
        # one thread in tritonclient's stop_stream (its close takes no lock): the half-close's; a server that keeps
        # the stream open has the call under it cancelled, which ends the response thread the half-close waits on
        call = getattr(getattr(self.client, "_stream", None), "_response_iterator", None)
        closer = threading.Thread(target=self.client.stop_stream, name="s3flow-stream-close", daemon=True)
        closer.start()
        closer.join(wait_s)
        if closer.is_alive() and call is not None:
            call.cancel()
            closer.join(wait_s)
        if not closer.is_alive():   # (else its stream's own deadline ends it: a second close would race it)
            self.client.close()
