"""gRPC streaming client of the token2mel / token2wav Triton ensembles: utterances with every token in hand
(``stream``), or fed live as a text-to-token model makes them (``live``)."""
from .chunking import LiveChunks, chunk_schedule
from .live import LiveClient, LiveStream, Piece
from .stream import StreamError, StreamingClient, StreamResult, Utterance, save_mel_png

__all__ = ["LiveChunks", "LiveClient", "LiveStream", "Piece", "StreamError", "StreamingClient", "StreamResult",
           "Utterance", "chunk_schedule", "save_mel_png"]
