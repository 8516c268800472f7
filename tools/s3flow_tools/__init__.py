"""Tools that measure s3flow from outside: the load test's, the benchmark's and the batching sweep's engines
(``bench``) and the one-shot GPU check's sections (``gpu_check``). The libraries (``s3flow``,
``s3flow_client``) never import them; ``scripts/`` are their command lines."""
