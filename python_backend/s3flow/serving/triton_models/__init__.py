"""Triton python-backend models, one per file over a shared base (``base.TritonModel``). They run inside the
Triton stub (``triton_python_backend_utils``) and import without it; each generated ``model.py`` is one line
that re-exports one of them.
"""
