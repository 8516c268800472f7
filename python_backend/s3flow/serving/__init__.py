"""The serving layer: everything Triton. The repository generator, the python models (``triton_models``),
the solver's sessions, the tritonserver launcher, drain, metrics, warm-up and voices."""
