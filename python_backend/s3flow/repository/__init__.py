"""Writing the model repository (build time): the generator, every ``config.pbtxt`` as a ``ModelConfig``
protobuf built from the tensor contract, the repository's settings, Triton's warm-up samples, and switching a
gpu repository's backends. Runs before the server starts (``scripts/build_repository.py``, the image's
entrypoint); nothing here runs inside Triton."""
