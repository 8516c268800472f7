"""How the client reaches a server: TLS and the gRPC metadata every call carries.

A plain loopback server needs nothing (``Channel()``). A server or router that terminates TLS needs the CA
that signed its certificate (``root_certificates``); with mutual TLS also the client's own key and
certificate chain. ``headers`` go with every call and stream: a tenant's credentials where a router
authenticates them, or the admin key of Triton's restricted API categories (docs/security.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import tritonclient.grpc as grpcclient


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
