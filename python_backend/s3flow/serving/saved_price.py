"""A solver (or vocoder) instance's price of its work, kept for the next server from the same repository on the
same host.

Admission prices a START by what the solver instances measured (``s3flow.engine.capacity``). A new instance learns
its price from a calibration over BLS (``s3flow.serving.calibration``), and BLS works only once the whole server is
ready (Triton refuses inference while models load: "Server not ready"), so a server just ready spends about 2 s
unpriced; a burst sent then waited for the price, and over-admitted by its calibrated prior (issue 48). An instance
that served before on this host from this repository knows better: at its close (and once calibrated, when it had
nothing better) it writes what it measured (``CapacityModel.state``: cost fits, correction, busy share at
capacity, capacity) to ``<model dir>/price/<instance>.json``; the next instance of that name reads it at set-up
(``CapacityModel.restore``) and is priced before its first request. The calibration still runs and refits the
costs; the measured correction, duty and capacity stay the priors until served work measures them again. The
vocoder keeps its own the same way (``models=VOCODER_PRICED``): a restarted server's token2wav capacity (the
solver's and the vocoder's device time) and the demand of each stream the vocoder holds are priced from its first
push.

A saved price holds only for what it was measured on: the file is keyed by the host (processor, usable cores, the
GPU) and the repository's solver, encoder and estimator (their configs, instance counts included, and their model
files' sizes and times): a rebuilt repository or another host starts from its calibration. It is part of the
repository, like a TensorRT engine built on first start: a repository on a read-only volume keeps none (logged once).

Example::

    saved = SavedPrice.beside(model_dir, "cfm_solver_0_0", device="CPU")
    state = saved.load()                     # None: nothing saved for this host and repository
    if state: capacity_model.restore(state)
    ...
    saved.save(capacity_model.state())       # at close
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Callable, Optional

from s3flow.serving.records import write_atomic

#: the models whose files and configs decide the solver's price (beside the solver's own folder), and the vocoder's
PRICED_MODELS = ("cfm_solver", "flow_encoder", "estimator")
VOCODER_PRICED = ("vocoder",)


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(instance_kind: str, device_id: Optional[int]) -> str:
    """What a price was measured on beside the processor: "CPU", or a GPU instance's GPU by name."""
    if instance_kind != "GPU" or device_id is None:
        return "CPU"
    import torch

    return torch.cuda.get_device_name(device_id)


def price_key(repository: Path, device: str, models: tuple = PRICED_MODELS) -> str:
    """The host (``device``: "CPU" or the GPU's name) and the priced ``models``' configs and files, hashed."""
    h = hashlib.sha256(f"{_processor()}|{len(os.sched_getaffinity(0))}|{device}".encode())
    for name in models:
        folder = Path(repository) / name
        config = folder / "config.pbtxt"
        if config.exists():
            h.update(config.read_bytes())
        for f in sorted(folder.glob("[0-9]*/*")):
            stat = f.stat()
            h.update(f"{f.relative_to(folder)}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


class SavedPrice:
    """One instance's saved price: a JSON file holding the key it was measured under and the state."""

    def __init__(self, path: Path, key: str, log: Callable[[str], None] = print):
        self.path, self.key, self.log = Path(path), key, log
        self._failed = False

    @classmethod
    def beside(cls, model_dir: Path, instance: str, device: str = "CPU", log: Callable[[str], None] = print,
               models: tuple = PRICED_MODELS) -> "SavedPrice":
        """The file of ``instance`` in its model's folder ``model_dir`` (``<repository>/cfm_solver``, or
        ``<repository>/vocoder`` with ``models=VOCODER_PRICED``)."""
        model_dir = Path(model_dir)
        return cls(model_dir / "price" / f"{instance}.json", price_key(model_dir.parent, device, models), log)

    def load(self) -> Optional[dict]:
        """The state saved under this key; None if there is none (or it was measured elsewhere)."""
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return saved.get("state") if isinstance(saved, dict) and saved.get("key") == self.key else None

    def restore_into(self, model) -> Optional[dict]:
        """Start ``model`` (a ``CapacityModel``) from the state saved here; that state, or None."""
        state = self.load()
        if state is not None:
            model.restore(state)
        return state

    def keep(self, model) -> None:
        """Save what ``model`` measured, once it has priced anything (an instance's close)."""
        if model.costs().known:
            self.save(model.state())

    def save(self, state: dict) -> None:
        """Replace the file with ``state``; a folder that cannot be written is logged once and left alone."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps({"key": self.key, "state": state}))
        except OSError as exc:
            if not self._failed:
                self._failed = True
                self.log(f"the price is not kept for the next server ({exc})")
