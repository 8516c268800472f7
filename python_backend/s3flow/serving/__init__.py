"""Inside Triton: the python models (``triton_models``) and what they run, Triton-free and unit-tested without
a server: the solver's session (``session``), its metrics (``metrics``), warm-up, voices (``voice_registry``,
``voice_service``), the drain probe (``draining``), error answers (``responses``) and config parameters
(``config_params``). Writing the repository is ``s3flow.repository``; running the server ``s3flow.server``."""
