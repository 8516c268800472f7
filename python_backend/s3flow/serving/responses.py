"""The python backend's utilities module and the error response every python model sends.

``pb_utils`` is ``triton_python_backend_utils`` inside the Triton stub, and None outside it, so that the
models stay importable there (the Docker image's build check imports them; tests give a stand-in). Every error
answer goes through :func:`error_response`, which states its disposition (``s3flow_contract.answers``) in the
message's tag: the one place the servers say what a client should do.
"""
from __future__ import annotations

from s3flow_contract.answers import Answer, tagged

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside the stub: importable, not runnable
    pb_utils = None

#: the error codes the models answer with, by the name of their ``pb_utils.TritonError`` attribute
INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL"


def error_response(message: str, code, answer: Answer):
    """An InferenceResponse carrying ``message`` tagged with ``answer`` (its disposition), with ``code`` (a
    ``pb_utils.TritonError`` code)."""
    message = tagged(message, answer)
    try:
        error = pb_utils.TritonError(message, code)
    except TypeError:  # older stubs take the message only
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
