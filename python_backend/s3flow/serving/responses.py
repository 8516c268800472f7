"""What the python models share: an error response with its code. Imported only inside the Triton stub."""
from __future__ import annotations

import triton_python_backend_utils as pb_utils


def error_response(message: str, code):
    """An InferenceResponse carrying ``message`` with ``code`` (a ``pb_utils.TritonError`` code)."""
    try:
        error = pb_utils.TritonError(message, code)
    except TypeError:  # older stubs take the message only
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
