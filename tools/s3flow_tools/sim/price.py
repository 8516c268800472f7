"""What the simulator is priced with, measured on the served path (issue 51).

* ``served_costs``: each ``cfm_solver`` instance saves its price at its close (``s3flow.serving.saved_price``: its
  cost fits and the correction that makes them price what the instance really took, busy over priced, under the
  load it served): the costs admission priced with, at load (two instances on two cores slow each other);
* ``fit_alone``: an instance working alone, fitted to a stream alone's chunk latencies, each chunk's calls and
  row-frames as the engine plans them (``chunk_work``).

Example::

    loaded = served_costs(repository)          # after the server on ``repository`` has stopped
    points = [(work, latency) for work, latency in zip(chunk_work(settings, utterance), result.chunk_latencies_s)]
    alone = fit_alone(points, loaded, queue_delay_s=0.002, transit_s=0.0013)
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
            for name in ("est_fixed", "est_per_unit", "enc_fixed", "enc_per_unit", "est_per_key")}
    return Costs(**mean, max_batch=max_batch)



def chunk_work(settings, utterance, n_feats: int = 80) -> list[tuple[int, int, int, int]]:
    """Each chunk of ``utterance`` streamed alone through the simulator: (encoder tokens, estimator calls,
    row-frames of those calls, cached key row-frames they read), as the engine plans them."""
    from s3flow_tools.sim.streams import run_streams
    from s3flow_tools.sim.virtual_server import Pricing, VirtualServer

    chunks: list[list[int]] = []

    def encoder(tokens: int) -> float:
        chunks.append([tokens, 0, 0, 0])
        return 0.0

    def estimator(rows: int, frames: int, key_frames: int) -> float:
        chunks[-1][1] += 1
        chunks[-1][2] += rows * frames
        chunks[-1][3] += rows * (key_frames - frames)
        return 0.0

    server = VirtualServer(settings, Costs(est_per_unit=1e-9), n_feats=n_feats, pricing=Pricing(estimator, encoder))
    run_streams(server, [utterance], [0.0], rules=settings.solver.rules)
    return [tuple(c) for c in chunks]


def fit_alone(points: list[tuple[tuple[int, int, int, int], float]], saved: Costs, queue_delay_s: float,
              transit_s: float) -> Costs:
    """The costs of an instance working alone, fitted to a stream alone's chunk latencies on the served path
    (``points``: (``chunk_work``, latency) pairs). A latency less the queue delay, the chunk's transit and its
    encoder call (at the ``saved`` encoder costs) is a part per chunk and a part per row-frame (least squares; a
    cached key row-frame priced at the ``saved`` ratio of a key's price to a row-frame's); the part per chunk, over
    the chunk's estimator calls, is a call's fixed part (on this host mostly the ONNX graph's per-operator dispatch
    and the solver's Python between calls)."""
    ratio = saved.est_per_key / saved.est_per_unit if saved.est_per_unit > 0 else 0.0
    x = np.array([[1.0, rf + ratio * kf] for (_, _, rf, kf), _ in points])
    y = np.array([lat - queue_delay_s - transit_s - saved.encoder_seconds(tokens)
                  for (tokens, *_), lat in points])
    (per_chunk, per_unit), *_ = np.linalg.lstsq(x, y, rcond=None)
    calls = float(np.mean([calls for (_, calls, *_), _ in points]))
    per_unit = max(float(per_unit), 1e-9)
    return Costs(max(float(per_chunk), 0.0) / max(calls, 1.0), per_unit, saved.enc_fixed,
                 saved.enc_per_unit, saved.max_batch, ratio * per_unit)
