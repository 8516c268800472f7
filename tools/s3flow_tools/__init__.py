"""Tools that measure s3flow from outside: the load test's, the benchmark's and the batching sweep's engines
(``bench``), the one-shot GPU check's sections (``gpu_check``) and the measurement drivers that write
``results/*.md`` (``measure``: each module a command, ``python -m s3flow_tools.measure.<name>``). The libraries
(``s3flow``, ``s3flow_client``) never import them; ``scripts/`` holds the command lines of ``bench`` and
``gpu_check``."""
