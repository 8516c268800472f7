"""The engine layer: Triton-free streaming state (per-sequence store, chunk engine, vocoder stream)."""
