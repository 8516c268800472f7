"""Measuring the served flow: the load test's engine (``load``), served streaming loads and Triton's
per-model statistics (``served``), the benchmark's results and tables (``report``), and the small seeded
repositories the measurements and their tests serve (``repos``, which needs the server package and torch).

``scripts/load_test.py``, ``scripts/benchmark.py`` and ``s3flow_tools.measure.warmup`` are thin CLIs over them.
Neither ``s3flow`` nor ``s3flow_client`` imports anything here.
"""
