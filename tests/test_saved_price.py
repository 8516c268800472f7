"""A solver instance's price kept for the next server from the same repository on the same host
(``s3flow.serving.saved_price``, issue 48: a server just ready spent ~2 s unpriced, BLS works only once it is ready).

The instances here are real ``SolverInstance`` s over the small torch networks (no Triton): one serves, closes
and saves; the next of that name is priced before its first request, with what the first measured.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from test_solver_instance import Slots, chunk, flow, records  # noqa: F401 (fixtures)
from helpers import torch_encoder
from s3flow.engine.capacity import DUTY_PRIOR, CapacityModel, Costs, Work
from s3flow.model.flow import TorchEstimator
from s3flow.repository.configs import solver_config
from s3flow.repository.settings import RepositorySettings
from s3flow.serving.config_params import Params
from s3flow.serving.load import LoadBoard
from s3flow.serving.saved_price import SavedPrice, price_key
from s3flow.serving.solver_instance import SolverInstance


def repository(tmp_path: Path) -> Path:
    """A repository's priced models as files: configs and model files."""
    for name in ("cfm_solver", "flow_encoder", "estimator"):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(f'name: "{name}"\n')
        (tmp_path / name / "1" / "model.onnx").write_bytes(b"weights")
    return tmp_path


def solver(flow, model_dir: Path) -> SolverInstance:
    config = solver_config(flow.config.n_feats, flow.config.meanflow, RepositorySettings(warmup=False))
    raw = {k: {"string_value": v.string_value} for k, v in config.parameters.items()}
    raw.update({"calibrate": {"string_value": "false"}, "default_steps": {"string_value": "2"}})
    return SolverInstance(Params({"parameters": raw}, "cfm_solver"), "cfm_solver", "cfm_solver_0",
                          torch_encoder(flow), TorchEstimator(flow.estimator), lambda *a: None, Slots(),
                          batch_size=4, saved=SavedPrice.beside(model_dir, "cfm_solver_0"))


def test_an_instance_that_served_leaves_its_price_and_the_next_is_priced_before_its_first_request(
        flow, records, tmp_path):
    model_dir = repository(tmp_path) / "cfm_solver"
    first = solver(flow, model_dir)
    try:
        assert not LoadBoard(LoadBoard.default_folder()).read().known, "nothing saved, no calibration: unpriced"
        for k in range(200):   # served work, until its busy time measures a capacity
            first.submit([chunk(1000 + k, 0, 10, start=True), chunk(2000 + k, 0, 14, start=True)])
            first.submit([chunk(1000 + k, 10, 30, end=True), chunk(2000 + k, 14, 30, end=True)])
            if first.capacity.capacity() is not None:
                break
        measured = first.capacity.state()
    finally:
        first.close()
    assert measured["served"] and measured["capacity"] > 0
    second = solver(flow, model_dir)
    try:
        load = LoadBoard(LoadBoard.default_folder()).read()
        assert load.known, "priced before its first request"
        assert load.capacity == pytest.approx(measured["capacity"]), "the capacity the first one measured"
        assert second.capacity.costs().est_per_unit == pytest.approx(
            measured["estimator"][1] * measured["correction"])
    finally:
        second.close()


def test_a_price_is_kept_only_for_the_host_and_repository_it_was_measured_on(tmp_path):
    repo = repository(tmp_path)
    saved = SavedPrice.beside(repo / "cfm_solver", "cfm_solver_0")
    model = CapacityModel()
    model.estimator_timed(2, 100, 0.02)
    model.estimator_timed(2, 300, 0.05)
    saved.save(model.state())
    assert SavedPrice.beside(repo / "cfm_solver", "cfm_solver_0").load() is not None
    assert SavedPrice.beside(repo / "cfm_solver", "cfm_solver_0", device="NVIDIA H200").load() is None, "another device"
    assert SavedPrice.beside(repo / "cfm_solver", "cfm_solver_1").load() is None, "another instance's own"
    key = price_key(repo, "CPU")
    (repo / "estimator" / "1" / "model.onnx").write_bytes(b"retrained")   # the repository rebuilt
    assert price_key(repo, "CPU") != key
    assert SavedPrice.beside(repo / "cfm_solver", "cfm_solver_0").load() is None
    (repo / "estimator" / "config.pbtxt").write_text('name: "estimator"\ninstance_group [{ count: 2 }]\n')
    assert price_key(repo, "CPU") != key, "another layout"


def test_the_vocoders_price_is_keyed_by_the_vocoder_and_the_solvers_by_its_own_models(tmp_path):
    from s3flow.serving.saved_price import VOCODER_PRICED

    repo = repository(tmp_path)
    (repo / "vocoder" / "1").mkdir(parents=True)
    (repo / "vocoder" / "config.pbtxt").write_text('name: "vocoder"\n')
    (repo / "vocoder" / "1" / "decoder.onnx").write_bytes(b"weights")
    solver_key, vocoder_key = price_key(repo, "CPU"), price_key(repo, "CPU", VOCODER_PRICED)
    assert solver_key != vocoder_key
    (repo / "vocoder" / "1" / "decoder.onnx").write_bytes(b"retrained")
    assert price_key(repo, "CPU") == solver_key and price_key(repo, "CPU", VOCODER_PRICED) != vocoder_key


def test_a_repository_that_cannot_be_written_keeps_no_price_and_says_so_once(tmp_path):
    repo = repository(tmp_path)
    (repo / "cfm_solver" / "price").write_text("a file where the folder would be")
    logged = []
    saved = SavedPrice(repo / "cfm_solver" / "price" / "cfm_solver_0.json", "k", log=logged.append)
    saved.save({"x": 1})
    saved.save({"x": 2})
    assert saved.load() is None and len(logged) == 1 and "not kept" in logged[0]


def test_a_restored_price_is_the_prior_until_served_work_measures_its_own():
    model = CapacityModel(max_batch=4)
    model.restore({"estimator": [0.004, 5e-5], "encoder": [0.001, 3e-5], "correction": 1.5, "duty": 0.55,
                   "served": True, "capacity": 3.2})
    assert model.costs().est_fixed == pytest.approx(0.006) and model.duty == 0.55 and model.prior_capacity == 3.2
    model.calibrated(1.0, Work(row_frames=1000, steps=4, chunks=2, encoder_tokens=50, frames=100), 4)
    assert model.prior_correction == 1.5, "a calibration does not replace a correction measured from served work"
    assert model.capacity() is None, "no served work here yet"


def test_a_model_started_from_a_price_given_prices_by_it_until_its_own_calls_are_timed():
    costs = Costs(est_fixed=0.004, est_per_unit=5e-5, enc_fixed=0.001, enc_per_unit=3e-5, max_batch=4,
                  est_per_key=2e-5)
    model = CapacityModel(max_batch=4)
    model.start_from(costs)
    assert model.costs() == costs and model.duty == DUTY_PRIOR and model.prior_capacity is None
    model.estimator_timed(2, 100, 0.5)
    assert model.costs().est_fixed != costs.est_fixed, "its own timed call replaces the price given"
