"""The drain probe the solver asks on every START: is this server draining (``s3flow.server.drain``)?

While the file named by ``S3FLOW_DRAIN_FILE`` (in the server's environment) exists, the solver answers every
START with a ``resume`` disposition (send it to another server) and goes on serving the sequences it holds.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

DRAIN_FILE_ENV = "S3FLOW_DRAIN_FILE"


def draining_probe(path: Optional[str] = None) -> Callable[[], bool]:
    """For the solver: a function telling whether this server is draining (its drain file exists)."""
    path = path if path is not None else os.environ.get(DRAIN_FILE_ENV, "")
    if not path:
        return lambda: False
    return lambda: os.path.exists(path)
