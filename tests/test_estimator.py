"""Tests of the flow-matching estimator (ConditionalDecoder) and its ONNX export.

Everything runs on CPU with the small config, except the parameter-count tests
(full size on the meta device, instant) and the full-size ONNX check
(``-m fullsize``; ~1-2 min, ~272 MB file in tmp_path).
"""

from __future__ import annotations

import time
from typing import Dict, Optional

import pytest
import torch
from torch import nn

from s3flow_contract import tensors as contract
from s3flow.model.estimator import ConditionalDecoder, EstimatorConfig, reset_time_embed_mixer
from s3flow.runtime.onnx_export import (
    ESTIMATOR_OUTPUT_NAME,
    check_estimator_onnx,
    estimator_input_names,
    export_estimator,
    make_estimator_inputs,
)

N_FEATS = 80


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def perturb_all_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Replaces EVERY parameter by seeded random values (biases, norms, mixer too)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif name.endswith("weight"):  # LayerNorm gains
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def small_model(meanflow: bool = False, seed: int = 0) -> ConditionalDecoder:
    torch.manual_seed(seed)
    return perturb_all_(ConditionalDecoder(EstimatorConfig.small(meanflow)), seed).eval()


def inputs(model: ConditionalDecoder, batch: int, frames: int, seed: int = 1, lengths=None) -> Dict[str, torch.Tensor]:
    return make_estimator_inputs(model, batch=batch, frames=frames, seed=seed, lengths=lengths)


def run(model: ConditionalDecoder, feed: Dict[str, torch.Tensor], r: Optional[torch.Tensor] = None) -> torch.Tensor:
    feed = dict(feed)
    if r is not None:
        feed["r"] = r
    with torch.no_grad():
        return model(**feed)


# --------------------------------------------------------------------------- #
# config / layout
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("meanflow, expected", [(False, 71_302_480), (True, 73_399_632)])
def test_full_size_parameter_count(meanflow: bool, expected: int) -> None:
    with torch.device("meta"):
        model = ConditionalDecoder(EstimatorConfig.full(meanflow))
    assert sum(p.numel() for p in model.parameters()) == expected
    assert ("time_embed_mixer.weight" in model.state_dict()) == meanflow


def test_full_size_state_dict_layout() -> None:
    with torch.device("meta"):
        sd = ConditionalDecoder(EstimatorConfig.full(meanflow=True)).state_dict()
    expected_shapes = {
        "time_mlp.linear_1.weight": (1024, 320),
        "time_mlp.linear_1.bias": (1024,),
        "time_mlp.linear_2.weight": (1024, 1024),
        "time_embed_mixer.weight": (1024, 2048),
        "down_blocks.0.0.mlp.1.weight": (256, 1024),
        "down_blocks.0.0.block1.block.0.weight": (256, 320, 3),
        "down_blocks.0.0.block1.block.2.weight": (256,),  # LayerNorm over channels
        "down_blocks.0.0.block2.block.2.bias": (256,),
        "down_blocks.0.0.res_conv.weight": (256, 320, 1),
        "down_blocks.0.1.3.attn1.to_k.weight": (512, 256),
        "down_blocks.0.2.weight": (256, 256, 3),
        "mid_blocks.3.1.2.attn1.to_q.weight": (512, 256),
        "mid_blocks.3.1.2.attn1.to_out.0.weight": (256, 512),
        "mid_blocks.3.1.2.attn1.to_out.0.bias": (256,),
        "mid_blocks.11.1.3.ff.net.0.proj.weight": (1024, 256),
        "mid_blocks.11.1.3.ff.net.2.weight": (256, 1024),
        "mid_blocks.11.1.3.norm3.bias": (256,),
        "up_blocks.0.0.block1.block.0.weight": (256, 512, 3),
        "up_blocks.0.2.bias": (256,),
        "final_block.block.2.weight": (256,),
        "final_proj.weight": (80, 256, 1),
        "final_proj.bias": (80,),
    }
    for key, shape in expected_shapes.items():
        assert tuple(sd[key].shape) == shape, key
    # diffusers-style attention: no q/k/v biases, no norm2/attn2 (no cross-attention)
    for absent in ("mid_blocks.0.1.0.attn1.to_q.bias", "mid_blocks.0.1.0.norm2.weight", "mid_blocks.12.0.res_conv.weight"):
        assert absent not in sd
    assert len(sd) == 911


def test_config_helpers() -> None:
    small = EstimatorConfig.small()
    assert small.in_channels == 4 * small.out_channels and small.n_feats == N_FEATS
    assert EstimatorConfig.full().n_feats == N_FEATS and EstimatorConfig.full().channels == (256,)
    assert EstimatorConfig.small(meanflow=True).meanflow and not EstimatorConfig.full().meanflow
    with pytest.raises(ValueError):
        EstimatorConfig(in_channels=300)


# --------------------------------------------------------------------------- #
# meanflow time mixer
# --------------------------------------------------------------------------- #
def test_time_mixer_init_is_identity_then_zero() -> None:
    model = ConditionalDecoder(EstimatorConfig.small(meanflow=True))
    d = model.config.time_embed_dim
    w = model.time_embed_mixer.weight
    assert w.shape == (d, 2 * d) and model.time_embed_mixer.bias is None
    assert torch.equal(w, torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1))
    assert ConditionalDecoder(EstimatorConfig.small()).time_embed_mixer is None


def test_fresh_mixer_ignores_r_perturbed_mixer_uses_it() -> None:
    model = small_model(meanflow=True)
    reset_time_embed_mixer(model.time_embed_mixer)  # everything else stays perturbed
    feed = inputs(model, batch=2, frames=50)
    r1, r2 = torch.tensor([0.1, 0.9]), torch.tensor([0.7, 0.2])
    assert torch.equal(run(model, feed, r1), run(model, feed, r2))

    perturb_all_(model.time_embed_mixer, seed=5)
    diff = (run(model, feed, r1) - run(model, feed, r2)).abs().max().item()
    assert diff > 1e-3


def test_r_required_iff_meanflow() -> None:
    mf, plain = small_model(meanflow=True), small_model(meanflow=False)
    feed = inputs(plain, batch=1, frames=20)
    with pytest.raises(ValueError):
        run(mf, feed)
    with pytest.raises(ValueError):
        run(plain, feed, r=torch.tensor([0.5]))


# --------------------------------------------------------------------------- #
# masking / batching
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("meanflow", [False, True])
def test_padded_batch_invariance(meanflow: bool) -> None:
    model = small_model(meanflow)
    g = torch.Generator().manual_seed(3)
    n, short, long_ = N_FEATS, 40, 64

    def utt(frames: int) -> Dict[str, torch.Tensor]:
        return {
            "x": torch.randn(1, n, frames, generator=g),
            "mu": torch.randn(1, n, frames, generator=g),
            "cond": torch.randn(1, n, frames, generator=g),
            "spks": torch.randn(1, n, generator=g),
            "t": torch.rand(1, generator=g),
            "r": torch.rand(1, generator=g),
        }

    a, b = utt(short), utt(long_)
    alone = {k: v for k, v in a.items() if meanflow or k != "r"}
    alone["mask"] = torch.ones(1, 1, short)
    out_alone = run(model, alone)

    batch: Dict[str, torch.Tensor] = {}
    for k in a:
        if k == "r" and not meanflow:
            continue
        if a[k].dim() == 3:  # pad utterance a with garbage (must be ignored)
            garbage = 100.0 * torch.randn(1, n, long_ - short, generator=g)
            batch[k] = torch.cat([torch.cat([a[k], garbage], dim=2), b[k]], dim=0)
        else:
            batch[k] = torch.cat([a[k], b[k]], dim=0)
    batch["mask"] = torch.ones(2, 1, long_)
    batch["mask"][0, :, short:] = 0.0
    out_batch = run(model, batch)

    assert out_batch.shape == (2, N_FEATS, long_)
    torch.testing.assert_close(out_batch[0:1, :, :short], out_alone, atol=1e-5, rtol=0)
    assert torch.all(out_batch[0, :, short:] == 0)
    b_alone = {k: v for k, v in b.items() if meanflow or k != "r"}
    b_alone["mask"] = torch.ones(1, 1, long_)
    torch.testing.assert_close(out_batch[1:2], run(model, b_alone), atol=1e-5, rtol=0)


def test_scalar_batch_time_broadcasts() -> None:
    """t (and r) of shape (1,) act like the same value repeated over the batch."""
    model = small_model(meanflow=True)
    feed = inputs(model, batch=3, frames=30)
    one = dict(feed, t=feed["t"][:1], r=feed["r"][:1])
    full = dict(feed, t=feed["t"][:1].expand(3), r=feed["r"][:1].expand(3))
    torch.testing.assert_close(run(model, one), run(model, full), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "param",
    [
        "down_blocks.0.0.block1.block.2.bias",  # LayerNorm in a resnet block
        "mid_blocks.1.1.0.norm1.bias",  # transformer LayerNorms
        "up_blocks.0.1.0.norm3.bias",
        "mid_blocks.0.1.0.attn1.to_out.0.bias",  # linear biases
        "mid_blocks.0.1.0.ff.net.0.proj.bias",
        "down_blocks.0.1.0.ff.net.2.bias",
        "time_mlp.linear_1.bias",
        "up_blocks.0.0.mlp.1.bias",
        "final_block.block.2.weight",
    ],
)
def test_norm_and_bias_parameters_are_used(param: str) -> None:
    model = small_model()
    feed = inputs(model, batch=2, frames=37)
    before = run(model, feed)
    with torch.no_grad():
        dict(model.named_parameters())[param].add_(0.5)
    assert (run(model, feed) - before).abs().max().item() > 1e-4


# --------------------------------------------------------------------------- #
# numerics
# --------------------------------------------------------------------------- #
# Outputs of upstream chatterbox's ConditionalDecoder (resemble-ai/chatterbox
# 5de7a54, diffusers 0.29.0) loaded with the state dict of small_model(meanflow)
# and fed make_estimator_inputs(batch=2, frames=24, seed=1) (valid lengths 24, 12).
# Our implementation matched it to 1.4e-6 when these were recorded.
_GOLDEN_INDEX = [(0, 0, 0), (0, 17, 5), (0, 79, 23), (1, 3, 0), (1, 40, 11), (1, 66, 7)]
_GOLDEN = {
    False: ([-0.094599, 1.193666, 0.976531, -0.341025, -0.854121, 0.688134], [0.597929, 0.303928]),
    True: ([0.192632, 0.972263, 0.969185, -0.53317, -1.069311, 0.864812], [0.650527, 0.312058]),
}


@pytest.mark.parametrize("meanflow", [False, True])
def test_matches_upstream_golden_values(meanflow: bool) -> None:
    model = small_model(meanflow)
    feed = inputs(model, batch=2, frames=24, seed=1)
    assert feed["mask"].sum(dim=(1, 2)).tolist() == [24.0, 12.0]
    out = run(model, feed)
    values, mean_abs = _GOLDEN[meanflow]
    got = torch.tensor([out[i].item() for i in _GOLDEN_INDEX])
    torch.testing.assert_close(got, torch.tensor(values), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.abs().mean(dim=(1, 2)), torch.tensor(mean_abs), atol=1e-4, rtol=0)


def test_attention_matches_sdpa() -> None:
    """Self-attention equals torch's SDPA with scale 1/sqrt(head_dim) and masked keys."""
    model = small_model()
    block = model.mid_blocks[0][1][0]
    attn = block.attn1
    g = torch.Generator().manual_seed(4)
    b, t, d = 2, 11, model.config.channels[0]
    x = torch.randn(b, t, d, generator=g)
    mask = torch.ones(b, 1, t)
    mask[1, :, 6:] = 0.0
    bias = ((1.0 - mask) * -1.0e10).unsqueeze(1)
    with torch.no_grad():
        got = attn(x, bias)

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, attn.heads, attn.dim_head).transpose(1, 2)

        ref = torch.nn.functional.scaled_dot_product_attention(
            heads(attn.to_q(x)), heads(attn.to_k(x)), heads(attn.to_v(x)), attn_mask=mask.bool().unsqueeze(1)
        )
        ref = attn.to_out[0](ref.transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- #
# ONNX
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("meanflow", [False, True])
def test_onnx_small_matches_torch(meanflow: bool, tmp_path) -> None:
    import onnx

    model = small_model(meanflow)
    path = export_estimator(model, tmp_path / "estimator.onnx")
    graph = onnx.load(str(path)).graph
    names = [i.name for i in graph.input]
    assert names == estimator_input_names(meanflow) == list(contract.names(contract.estimator_inputs(meanflow)))
    assert [o.name for o in graph.output] == [ESTIMATOR_OUTPUT_NAME] == list(contract.names(contract.ESTIMATOR_OUTPUTS))
    x_dims = [d.dim_param or d.dim_value for d in graph.input[0].type.tensor_type.shape.dim]
    assert x_dims == ["batch", N_FEATS, "time"]

    # shapes differ from the export trace (B=2, T=48): dynamic axes really work
    for batch, frames in [(2, 300), (3, 131), (1, 17)]:
        err = check_estimator_onnx(model, path, batch=batch, frames=frames, seed=7)
        assert err < 1e-4, (batch, frames, err)


def test_check_estimator_onnx_detects_mismatch(tmp_path) -> None:
    model = small_model()
    path = export_estimator(model, tmp_path / "estimator.onnx")
    with torch.no_grad():
        model.final_proj.bias.add_(1e-2)
    assert check_estimator_onnx(model, path, batch=2, frames=40) > 5e-3


@pytest.mark.fullsize
@pytest.mark.parametrize("meanflow", [False, True])
def test_onnx_full_size_matches_torch(tmp_path, meanflow) -> None:
    torch.manual_seed(0)
    model = perturb_all_(ConditionalDecoder(EstimatorConfig.full(meanflow=meanflow)), seed=0).eval()
    t0 = time.perf_counter()
    path = export_estimator(model, tmp_path / "estimator.onnx")
    t_export = time.perf_counter() - t0
    size_mb = path.stat().st_size / 2**20
    t0 = time.perf_counter()
    err = check_estimator_onnx(model, path, batch=2, frames=300, seed=0)
    t_check = time.perf_counter() - t0
    print(f"\nfull-size export {t_export:.1f}s, {size_mb:.1f} MiB, check {t_check:.1f}s, max abs err {err:.2e}")
    assert 265 < size_mb < 285
    assert err < 1e-4
