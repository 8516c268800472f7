"""Which torch device a Triton model instance runs on (Triton-free, shared by the torch-backed models)."""
from __future__ import annotations


def instance_device(instance_kind: str | None, device_id: int | str = 0) -> str:
    """``cuda:<id>`` for a KIND_GPU instance, ``cpu`` for KIND_CPU / KIND_MODEL; ValueError otherwise."""
    kind = (instance_kind or "CPU").upper()
    if kind == "GPU":
        return f"cuda:{int(device_id)}"
    if kind in ("CPU", "MODEL"):
        return "cpu"
    raise ValueError(f"instance kind must be KIND_GPU or KIND_CPU, got {instance_kind!r}")
