"""The python backend's utilities module and the error response every python model sends.

``pb_utils`` is ``triton_python_backend_utils`` inside the Triton stub, and None outside it, so that the
models stay importable there (the Docker image's build check imports them; tests give a stand-in).
"""
from __future__ import annotations

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside the stub: importable, not runnable
    pb_utils = None

#: the error codes the models answer with, by the name of their ``pb_utils.TritonError`` attribute
INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL"


def error_response(message: str, code):
    """An InferenceResponse carrying ``message`` with ``code`` (a ``pb_utils.TritonError`` code)."""
    try:
        error = pb_utils.TritonError(message, code)
    except TypeError:  # older stubs take the message only
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
