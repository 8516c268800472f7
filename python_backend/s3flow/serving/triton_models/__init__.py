"""Triton python-backend models. Imported only inside the Triton stub (they need
``triton_python_backend_utils``); each generated ``model.py`` is one line that re-exports one of them.
"""
