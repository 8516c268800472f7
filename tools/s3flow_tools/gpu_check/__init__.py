"""The one-shot device check's library (scripts/gpu_check.py is its command line): ``report`` (checks,
bounds, markdown, clock, environment), ``flows`` (plans, seeded flows and utterances, the estimator's modes
on a device), ``sections`` (precision, estimator timing, TensorRT)."""
