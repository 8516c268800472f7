"""gRPC streaming client of the token2mel Triton ensemble (see ``stream``)."""
from .stream import (StreamError, StreamingClient, StreamResult, Utterance, chunk_schedule,
                     save_mel_png)

__all__ = ["StreamError", "StreamingClient", "StreamResult", "Utterance", "chunk_schedule", "save_mel_png"]
