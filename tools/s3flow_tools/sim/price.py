"""What the simulator is priced with: the costs a served repository's solver instances measured (issue 51).

Each ``cfm_solver`` instance saves its price at its close (``s3flow.serving.saved_price``: its cost fits, the
correction that makes them price what the instance really took, busy over priced, under the load it served): the
costs admission priced with. The simulator takes their mean over the instances, so a run of the server and the
simulator of that run share one cost model, measured by the server.

Example::

    costs = served_costs(repository)          # after the server on ``repository`` has stopped
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from s3flow.engine.capacity import CapacityModel, Costs


def served_costs(repository: Path, max_batch: int = 8) -> Costs:
    """The mean of the solver instances' saved costs (fits times correction) in ``repository``; ValueError when
    none saved one (the server never ran, or its model folder could not be written)."""
    found = sorted((Path(repository) / "cfm_solver" / "price").glob("*.json"))
    costs = []
    for path in found:
        model = CapacityModel(max_batch=max_batch)
        model.restore(json.loads(path.read_text())["state"])
        costs.append(model.costs())
    if not costs:
        raise ValueError(f"no saved price under {repository}/cfm_solver/price: run a server on it first")
    mean = {name: float(np.mean([getattr(c, name) for c in costs]))
            for name in ("est_fixed", "est_per_unit", "enc_fixed", "enc_per_unit")}
    return Costs(**mean, max_batch=max_batch)

