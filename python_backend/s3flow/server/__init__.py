"""Around the server (a process of its own): starting tritonserver with this project's python-backend stub and
venv and stopping it by PID (``triton_server``, ``install``, ``processes``), the graceful drain supervisor
(``drain``), and reading its metrics back (``metrics_reader``)."""
