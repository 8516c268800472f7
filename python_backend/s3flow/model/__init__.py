"""The model layer: torch ports of S3Gen's flow decoder (estimator, encoder, flow, solver, chunks), the HiFT
vocoder, the voice front-end, the upstream checkpoint layout. Imports nothing above it."""
