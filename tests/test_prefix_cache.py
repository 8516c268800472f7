"""The estimator's prefix cache: what it reads of earlier frames, kept from one call and given to a later one."""
import pytest
import torch

from s3flow.model.estimator import ConditionalDecoder, EstimatorConfig
from s3flow.model.prefix_cache import CacheShape, PrefixCache


def _inputs(b: int, t: int, meanflow: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, mu, cond = (torch.randn(b, 80, t, generator=g) for _ in range(3))
    mask = torch.ones(b, 1, t)
    mask[-1, :, t - 5:] = 0.0            # the last row is padded
    extra = {"r": torch.rand(b, generator=g)} if meanflow else {}
    return dict(x=x, mask=mask, mu=mu, t=torch.rand(b, generator=g), spks=torch.randn(b, 80, generator=g),
                cond=cond, **extra)


def _rest(inputs: dict, i: int, p: int) -> dict:
    """Row ``i`` from frame ``p`` on."""
    return {k: (v[i:i + 1, :, p:] if v.dim() == 3 else v[i:i + 1]) for k, v in inputs.items()}


@pytest.mark.parametrize("meanflow", [False, True])
def test_a_row_after_its_kept_prefix_equals_the_whole_rows_output(meanflow):
    """Record the first P frames' states in a call over whole rows; each row's remaining frames alone, reading
    them, give exactly the whole call's output there (rows of different P, one with none)."""
    torch.manual_seed(0)
    model = ConditionalDecoder(EstimatorConfig.small(meanflow)).eval()
    inputs = _inputs(3, 40, meanflow)
    keep = torch.tensor([12, 7, 0])
    with torch.no_grad():
        whole = model(**inputs)
        again, cache = model(**inputs, keep=keep)
        torch.testing.assert_close(again, whole, atol=0, rtol=0)   # recording changes nothing
        for i, p in enumerate(keep.tolist()):
            past = PrefixCache.stack([cache.row(i)]) if p else None
            alone = model(**_rest(inputs, i, p), past=past)
            torch.testing.assert_close(alone, whole[i:i + 1, :, p:], atol=1e-5, rtol=0)


def test_rows_reading_caches_of_different_lengths_batch_as_they_run_alone():
    torch.manual_seed(1)
    model = ConditionalDecoder(EstimatorConfig.small()).eval()
    inputs = _inputs(3, 30, False, seed=2)
    keep = torch.tensor([10, 4, 0])
    with torch.no_grad():
        whole, cache = model(**inputs, keep=keep)
        past = PrefixCache.stack([cache.row(0), cache.row(1), None])
        t = 30
        rows = {k: torch.zeros_like(v) if v.dim() == 3 else v.clone() for k, v in inputs.items()}
        for i, p in enumerate(keep.tolist()):
            for k, v in inputs.items():
                if v.dim() == 3:
                    rows[k][i, :, :t - p] = v[i, :, p:]
        batched = model(**rows, past=past)
    for i, p in enumerate(keep.tolist()):
        n = int(inputs["mask"][i, 0, p:].sum())
        torch.testing.assert_close(batched[i, :, :n], whole[i, :, p:p + n], atol=1e-5, rtol=0)


def test_a_kept_prefix_holds_every_attention_layer_and_causal_convolution():
    cfg = EstimatorConfig.small()
    model = ConditionalDecoder(cfg).eval()
    with torch.no_grad():
        _, cache = model(**_inputs(1, 20, False), keep=torch.tensor([6]))
    shape = CacheShape.of(cfg)
    assert shape.layers == cfg.n_blocks * (2 + cfg.num_mid_blocks) == 4
    assert shape.convs == 2 * (2 + cfg.num_mid_blocks) + 3 == 11
    assert cache.keys.shape == cache.values.shape == (shape.layers, 1, cfg.num_heads, 6, cfg.attention_head_dim)
    assert cache.convs.shape == (shape.convs, 1, shape.width, 2)   # kernel 3: the two frames before
    assert (CacheShape.of(EstimatorConfig.full()).layers, CacheShape.of(EstimatorConfig.full()).convs) == (56, 31)


def test_a_multi_level_unet_refuses_a_prefix_cache():
    model = ConditionalDecoder(EstimatorConfig(channels=(64, 64), attention_head_dim=32, n_blocks=1,
                                               num_mid_blocks=1, num_heads=2)).eval()
    with pytest.raises(ValueError, match="one-level"):
        model(**_inputs(1, 16, False), keep=torch.tensor([4]))


@pytest.mark.parametrize("meanflow", [False, True])
def test_the_cached_onnx_graph_equals_torch_at_shapes_other_than_its_trace(tmp_path, meanflow):
    """The exported cached graph (what the estimator serves with keep_solved) against the torch module: past and
    keep lengths are data, not traced constants."""
    import numpy as np
    import onnxruntime as ort

    from s3flow.runtime.onnx_export import CachedGraph, export_estimator, make_cache_inputs, make_estimator_inputs

    torch.manual_seed(3)
    model = ConditionalDecoder(EstimatorConfig.small(meanflow)).eval()
    path = export_estimator(model, tmp_path / "cached.onnx", cached=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, frames, past, keep in ((3, 60, 9, [20, 0, 4]), (1, 30, 1, [0]), (2, 17, 30, [17, 17])):
        inputs = make_estimator_inputs(model, batch, frames, seed=2)
        inputs.update(make_cache_inputs(model, batch, past, keep, seed=3))
        with torch.no_grad():
            want = CachedGraph(model)(*inputs.values())
        got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        assert [o.name for o in session.get_outputs()] == ["velocity", "kept"]
        assert [g.shape for g in got] == [tuple(w.shape) for w in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.numpy(), atol=1e-4, rtol=0)


def test_the_torch_runner_serves_the_cached_graph():
    """``--gpu-backend torch``'s runner with the cache's tensors by their contract names."""
    from s3flow.runtime.onnx_export import make_cache_inputs, make_estimator_inputs
    from s3flow.runtime.torch_runner import TorchRunner

    torch.manual_seed(4)
    model = ConditionalDecoder(EstimatorConfig.small()).eval()
    shape = CacheShape.of(model.config)
    runner = TorchRunner(model, "estimator", cached=True)
    assert runner.input_names[-1] == "past" and runner.output_names == ("velocity", "kept")
    inputs = make_estimator_inputs(model, 2, 20, seed=1)
    cache = make_cache_inputs(model, 2, 6, [5, 0], seed=2)
    out = runner(**inputs, **cache)
    past, keep = shape.unpack_past(cache["past"], 2)
    assert keep.tolist() == [5, 0]
    with torch.no_grad():
        v, kept = model(**inputs, past=past, keep=keep)
    torch.testing.assert_close(out["velocity"], v)
    got = shape.unpack_kept(out["kept"], 2)
    torch.testing.assert_close(got.keys, kept.keys)
    assert got.mask.tolist() == [[[1.0] * 5], [[0.0] * 5]]


def test_a_cache_packs_into_one_tensor_and_back():
    shape = CacheShape(layers=3, heads=2, head_dim=4, convs=5, width=6)
    g = torch.Generator().manual_seed(0)
    cache = PrefixCache(torch.randn(3, 2, 2, 7, 4, generator=g), torch.randn(3, 2, 2, 7, 4, generator=g),
                        torch.randn(5, 2, 6, 2, generator=g), torch.ones(2, 1, 7))
    back, keep = shape.unpack_past(shape.pack_past(cache, torch.tensor([3, 0])), 2)
    assert keep.tolist() == [3, 0]
    for a, b in ((back.keys, cache.keys), (back.values, cache.values), (back.convs, cache.convs),
                 (back.mask, cache.mask)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    kept = shape.unpack_kept(shape.pack_kept(cache), 2)
    torch.testing.assert_close(kept.keys, cache.keys, atol=0, rtol=0)
