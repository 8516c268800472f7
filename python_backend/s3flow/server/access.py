"""Who may call what on a tritonserver: restricted API categories behind a key, and gRPC TLS.

Triton groups its API into categories (health, metadata, inference, shared-memory, model-config,
model-repository, statistics, trace, logging) and can demand a header for any of them
(``--grpc-restricted-protocol=<categories>:<header>=<value>``, ``--http-restricted-api=...``). The fleet's
clients stream inference and ask health; nothing else is theirs:

* gRPC: health, metadata and inference stay open; the rest (``RESTRICTED_GRPC``) needs the admin key.
* HTTP: only health stays open (the router's and the kubelet's probes); every other category needs the key.

Our own tools that use a restricted category (``scripts/server.py status``: model-repository;
``s3flow_tools.bench.served``: statistics; ``s3flow_tools.measure.batching``: model-config) send the key from
``S3FLOW_ADMIN_KEY`` (``admin_headers``). The container's entrypoint takes the key from the file
``S3FLOW_ADMIN_KEY_FILE`` names (``python -m s3flow.server.access flags FILE``). docs/security.md has the
trust model.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

#: every category Triton knows (tritonserver --help)
CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
              "statistics", "trace", "logging")
#: categories a streaming client needs, per protocol
OPEN_GRPC = ("health", "metadata", "inference")
OPEN_HTTP = ("health",)
RESTRICTED_GRPC = tuple(c for c in CATEGORIES if c not in OPEN_GRPC)
RESTRICTED_HTTP = tuple(c for c in CATEGORIES if c not in OPEN_HTTP)
#: the header that carries the admin key over HTTP (lower case: gRPC metadata keys are) ...
ADMIN_KEY_HEADER = "s3flow-admin-key"
#: ... and over gRPC, where Triton expects the rule's key behind its own prefix (measured on Triton 2.51:
#: "This protocol is restricted, expecting header 'triton-grpc-protocol-s3flow-admin-key'")
GRPC_ADMIN_KEY_HEADER = "triton-grpc-protocol-" + ADMIN_KEY_HEADER
#: where our tools find the key
ADMIN_KEY_ENV = "S3FLOW_ADMIN_KEY"

_KEY = re.compile(r"[A-Za-z0-9._~+/-]{16,256}")


def check_admin_key(key: str) -> str:
    """The key, if it can be a header value Triton's flag parser and gRPC metadata both take unchanged."""
    if not _KEY.fullmatch(key):
        raise ValueError(f"admin key of {len(key)} characters: it must be 16-256 characters of "
                         "A-Z a-z 0-9 . _ ~ + / - (no ',', ':', '=' or spaces, which the flag syntax uses)")
    return key


def restricted_api_flags(key: str) -> list[str]:
    """tritonserver flags that put every category but the open ones behind ``ADMIN_KEY_HEADER: key``."""
    check_admin_key(key)
    rule = f"{ADMIN_KEY_HEADER}={key}"
    return [f"--grpc-restricted-protocol={','.join(RESTRICTED_GRPC)}:{rule}",
            f"--http-restricted-api={','.join(RESTRICTED_HTTP)}:{rule}"]


def tenant_flags() -> list[str]:
    """tritonserver flags that forward the tenant header to the models as a request parameter (through the
    ensembles to every step): voices are then per tenant (``s3flow.serving.voice_registry``). Only where the
    one entry in front (the router) sets that header after authenticating the client: a client that reaches
    tritonserver itself could name any tenant."""
    from s3flow.protocol import TENANT_HEADER

    return [f"--grpc-header-forward-pattern={TENANT_HEADER}", f"--http-header-forward-pattern={TENANT_HEADER}"]


#: where the container's entrypoint finds the admin key file (a mounted Secret)
ADMIN_KEY_FILE_ENV = "S3FLOW_ADMIN_KEY_FILE"


def read_admin_key(key_file: Optional[Path] = None) -> Optional[str]:
    """The admin key in ``key_file`` (default ``$S3FLOW_ADMIN_KEY_FILE``), else ``$S3FLOW_ADMIN_KEY``, else None."""
    path = key_file or os.environ.get(ADMIN_KEY_FILE_ENV)
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(ADMIN_KEY_ENV)


def admin_headers(key: Optional[str] = None, protocol: str = "grpc") -> dict[str, str]:
    """Headers for a ``protocol`` ("grpc" or "http") call to a restricted category: the key given, else
    ``$S3FLOW_ADMIN_KEY``, else none."""
    key = key if key is not None else os.environ.get(ADMIN_KEY_ENV)
    return {GRPC_ADMIN_KEY_HEADER if protocol == "grpc" else ADMIN_KEY_HEADER: key} if key else {}


@dataclass(frozen=True)
class ServerTls:
    """Triton's own gRPC TLS: its certificate and key; with ``client_ca``, mutual TLS (clients must present
    a certificate that CA signed)."""
    certificate: Path
    key: Path
    client_ca: Optional[Path] = None

    def flags(self) -> list[str]:
        for what in ("certificate", "key", "client_ca"):
            path = getattr(self, what)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"ServerTls.{what}={path}: no such file")
        flags = ["--grpc-use-ssl=true", f"--grpc-server-cert={self.certificate}", f"--grpc-server-key={self.key}"]
        if self.client_ca is not None:
            flags += ["--grpc-use-ssl-mutual=true", f"--grpc-root-cert={self.client_ca}"]
        return flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m s3flow.server.access",
                                description="print the tritonserver flags of an access setting, one per line")
    sub = p.add_subparsers(dest="command", required=True)
    flags = sub.add_parser("flags", help="the restricted-API flags for the admin key in KEY_FILE")
    flags.add_argument("key_file", type=Path, help="a file holding the admin key (a mounted Secret)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print("\n".join(restricted_api_flags(read_admin_key(args.key_file))))
    except (OSError, ValueError) as exc:
        print(f"error: {args.key_file}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
