"""Triton python-backend models. Imported only inside the Triton stub (they need
``triton_python_backend_utils``); each generated ``model.py`` is one line that re-exports one of them.
The logic they call lives in ``s3flow.protocol`` and ``s3flow.streaming`` and is tested without a server.
"""
