"""The H200 projection's pricing (``s3flow_tools.measure.projection``): a call is its launch floor plus its FLOPs at
the stated rate, the GPU check's figures replace both by a fit, and a stream's kept caches are what the cache
layout says. Triton-free; the projection itself runs in seconds (results/projection.md)."""
from __future__ import annotations

import json

import pytest

from s3flow.model.estimator import EstimatorConfig
from s3flow.model.flops import estimator_flops
from s3flow.model.prefix_cache import CacheShape
from s3flow_tools.measure.projection import Gpu, linear_costs, measured_gpu, pricing, stream_bytes

GPU = Gpu(peak_tflops=1000.0, efficiency=0.5, call_floor_s=1e-3)


def test_a_call_is_its_floor_plus_its_flops_at_the_stated_rate_and_a_cached_call_attends_over_its_cache():
    price = pricing(GPU, enc_per_token=1e8, voc_per_frame=2e8, vocoder=True)
    full = EstimatorConfig.full()
    assert price.estimator(2, 300, 300) == pytest.approx(1e-3 + estimator_flops(full, 2, 300).total / 5e14)
    assert price.estimator(2, 100, 250) == pytest.approx(1e-3 + estimator_flops(full, 2, 100, 250).total / 5e14)
    assert price.estimator(2, 100, 250) > price.estimator(2, 100, 100), "keys over the cache cost too"
    assert price.encoder(100) == pytest.approx(1e-3 + 1e10 / 5e14)
    assert price.vocoder(50) == pytest.approx(1e-3 + 1e10 / 5e14)
    assert pricing(GPU, 1e8, 2e8, vocoder=False).vocoder is None


def test_the_gpu_checks_figures_replace_the_floor_and_the_rate(tmp_path):
    full = EstimatorConfig.full()
    figures = {f"R{r}/T{t}": 1e3 * (2e-3 + estimator_flops(full, r, t).total / 3e14)
               for r in (2, 16, 64) for t in (64, 150, 300)}
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({"data": {"scaling": {"graph_bf16_ms": figures}}}))
    got = measured_gpu(path, GPU)
    assert got.call_floor_s == pytest.approx(2e-3, rel=1e-6) and got.flops_per_s == pytest.approx(3e14, rel=1e-6)
    path.write_text(json.dumps({"data": {}}))
    with pytest.raises(SystemExit, match="no scaling figures"):
        measured_gpu(path, GPU)


def test_the_step_loops_linear_costs_fit_the_calls():
    costs = linear_costs(pricing(GPU, 1e8, 2e8, vocoder=False))
    price = pricing(GPU, 1e8, 2e8, vocoder=False)
    assert costs.step_seconds(64, 200) == pytest.approx(price.estimator(64, 200, 200), rel=0.1)


def test_a_streams_kept_caches_are_its_keys_and_values_per_frame_step_and_half_in_fp16():
    shape = CacheShape.of(EstimatorConfig.full())
    per_frame = 2 * shape.layers * shape.heads * shape.head_dim * 2
    assert stream_bytes(0, False) == 0
    assert stream_bytes(2, False) == per_frame * 150 * 10 * 2
    assert stream_bytes(1, True) == per_frame * 50 * 2 * 1
