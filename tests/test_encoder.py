"""Tests of the flow encoder (s3flow.model.encoder): layout, masking, padding, lookahead, ONNX export."""
from __future__ import annotations

import math

import onnx
import pytest
import torch

from s3flow.model.encoder import (CausalUpsample, EncoderConfig, FlowEncoder, PreLookaheadLayer,
                                  RelPositionSelfAttention, length_mask, random_encoder_inputs, rel_shift,
                                  relative_position_table)
from s3flow.runtime.onnx_export import ENCODER_INPUT_NAMES, ENCODER_OUTPUT_NAMES, check_encoder_onnx, export_encoder

# Measured by building upstream's CausalMaskedDiffWithXvec encoder side (UpsampleConformerEncoder with
# the s3gen.py arguments, input_embedding, spk_embed_affine_layer, encoder_proj) at chatterbox commit
# 5de7a54: 41,246,880 parameters in 211 state-dict tensors, 37,831,168 of them in `encoder`.
UPSTREAM_PARAMS = 41_246_880
UPSTREAM_ENCODER_PARAMS = 37_831_168
UPSTREAM_KEYS = 211

ATOL = 1e-5


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    """Randomise every parameter (biases and norms too, which default to fixed values)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            noise = torch.randn(p.shape, generator=gen)
            if isinstance(module, torch.nn.LayerNorm) and name == "weight":
                p.copy_(1.0 + scale * noise)
            elif name == "bias":
                p.copy_(scale * noise)
            else:
                p.add_(scale * p.std() * noise)
    return model


@pytest.fixture(scope="module")
def small() -> FlowEncoder:
    torch.manual_seed(0)
    return perturb(FlowEncoder(EncoderConfig.small()), seed=1).eval()


def run(model: FlowEncoder, tokens, token_len, emb):
    with torch.no_grad():
        return model(tokens, token_len, emb)


# --- layout -------------------------------------------------------------------------------------------

def test_full_size_state_dict_matches_upstream_layout():
    with torch.device("meta"):
        enc = FlowEncoder(EncoderConfig.full())
    sd = enc.state_dict()
    assert len(sd) == UPSTREAM_KEYS
    assert sum(p.numel() for p in enc.parameters()) == UPSTREAM_PARAMS
    assert sum(p.numel() for p in enc.encoder.parameters()) == UPSTREAM_ENCODER_PARAMS
    assert "encoder.pos_table" not in sd  # the positional table is derived, not a checkpoint tensor
    expected = {
        "input_embedding.weight": (6561, 512),
        "spk_embed_affine_layer.weight": (80, 192),
        "spk_embed_affine_layer.bias": (80,),
        "encoder_proj.weight": (80, 512),
        "encoder_proj.bias": (80,),
        "encoder.embed.out.0.weight": (512, 512),
        "encoder.embed.out.1.bias": (512,),
        "encoder.pre_lookahead_layer.conv1.weight": (512, 512, 4),
        "encoder.pre_lookahead_layer.conv2.weight": (512, 512, 3),
        "encoder.encoders.0.self_attn.pos_bias_u": (8, 64),
        "encoder.encoders.5.self_attn.pos_bias_v": (8, 64),
        "encoder.encoders.5.self_attn.linear_pos.weight": (512, 512),
        "encoder.encoders.5.self_attn.linear_k.bias": (512,),
        "encoder.encoders.5.feed_forward.w_1.weight": (2048, 512),
        "encoder.encoders.5.feed_forward.w_2.bias": (512,),
        "encoder.encoders.5.norm_mha.weight": (512,),
        "encoder.encoders.5.norm_ff.bias": (512,),
        "encoder.up_layer.conv.weight": (512, 512, 5),
        "encoder.up_embed.out.0.weight": (512, 512),
        "encoder.up_embed.out.1.weight": (512,),
        "encoder.up_encoders.3.self_attn.linear_out.weight": (512, 512),
        "encoder.up_encoders.3.feed_forward.w_1.bias": (2048,),
        "encoder.after_norm.weight": (512,),
    }
    for key, shape in expected.items():
        assert tuple(sd[key].shape) == shape, key
    assert "encoder.encoders.6.norm_ff.weight" not in sd
    assert "encoder.up_encoders.4.norm_ff.weight" not in sd
    assert "encoder.encoders.0.self_attn.linear_pos.bias" not in sd  # upstream: bias=False


def test_state_dict_round_trip_and_config_validation():
    a = perturb(FlowEncoder(EncoderConfig.small()), seed=3).eval()
    b = FlowEncoder(EncoderConfig.small()).eval()
    b.load_state_dict(a.state_dict(), strict=True)
    inputs = random_encoder_inputs(a.config, 2, 9, seed=0)
    for x, y in zip(run(a, *inputs), run(b, *inputs)):
        assert torch.equal(x, y)
    with pytest.raises(ValueError):
        EncoderConfig(use_cnn_module=True)
    with pytest.raises(ValueError):
        EncoderConfig(input_size=256)


# --- building blocks -------------------------------------------------------------------------------------

def test_relative_position_table_values():
    table = relative_position_table(10, 8)
    assert table.shape == (19, 8)
    # row r is relative position 9 - r; row 9 is position 0: sin 0 = 0, cos 0 = 1
    assert torch.equal(table[9], torch.tensor([0.0, 1.0] * 4))
    pos, i = 9 - 2, 3  # row 2, frequency pair 3 -> columns 6 (sin), 7 (cos)
    angle = pos * math.exp(-(2 * i) * math.log(10000.0) / 8)
    assert table[2, 6].item() == pytest.approx(math.sin(angle), abs=1e-6)
    assert table[2, 7].item() == pytest.approx(math.cos(angle), abs=1e-6)
    # negative positions: sin odd, cos even
    assert torch.allclose(table[:9].flip(0), table[10:] * torch.tensor([-1.0, 1.0] * 4), atol=1e-6)


@pytest.mark.parametrize("t", [1, 2, 5])
def test_rel_shift_picks_relative_position(t):
    x = torch.randn(2, 3, t, 2 * t - 1)
    out = rel_shift(x)
    assert out.shape == (2, 3, t, t)
    for i in range(t):
        for j in range(t):
            assert torch.equal(out[..., i, j], x[..., i, t - 1 - i + j])


def test_attention_matches_naive_relative_attention():
    torch.manual_seed(0)
    t, d, h = 6, 16, 2
    attn = perturb(RelPositionSelfAttention(h, d), seed=2).eval()
    x = torch.randn(1, t, d)
    lens = torch.tensor([4])
    table = relative_position_table(t, d)
    with torch.no_grad():
        got = attn(x, length_mask(lens, t), table[None])
        q = attn.linear_q(x).view(t, h, -1)
        k = attn.linear_k(x).view(t, h, -1)
        v = attn.linear_v(x).view(t, h, -1)
        ref = torch.zeros(t, h, d // h)
        for i in range(t):
            for hh in range(h):
                scores = []
                for j in range(int(lens)):
                    p = attn.linear_pos(table[t - 1 - (i - j)]).view(h, -1)[hh]  # relative position i - j
                    s = (q[i, hh] + attn.pos_bias_u[hh]) @ k[j, hh] + (q[i, hh] + attn.pos_bias_v[hh]) @ p
                    scores.append(s / math.sqrt(d // h))
                w = torch.softmax(torch.stack(scores), 0)
                ref[i, hh] = (w[:, None] * v[:int(lens), hh]).sum(0)
        ref = attn.linear_out(ref.reshape(1, t, d))
    assert torch.allclose(got, ref, atol=1e-5)


def test_pre_lookahead_layer_receptive_field():
    torch.manual_seed(0)
    layer = perturb(PreLookaheadLayer(8, pre_lookahead_len=3), seed=4).eval()
    x = torch.randn(1, 20, 8)
    k = 10
    y = x.clone()
    y[0, k] += 1.0
    with torch.no_grad():
        changed = (layer(x) - layer(y)).abs().amax(-1)[0] > 0
    # conv1 reads t..t+3, conv2 reads t-2..t: output t sees inputs t-2..t+3, so input k reaches k-3..k+2
    assert changed.nonzero().flatten().tolist() == list(range(k - 3, k + 3))


def test_upsample_is_causal_and_doubles():
    torch.manual_seed(0)
    up = perturb(CausalUpsample(4, 4, stride=2), seed=5).eval()
    x = torch.randn(1, 4, 10)
    y = x.clone()
    y[0, :, 5] += 1.0
    with torch.no_grad():
        a, b = up(x), up(y)
    assert a.shape == (1, 4, 20)
    changed = (a - b).abs().amax(1)[0] > 0
    # frame f reads repeated frames f-4..f, i.e. tokens (f-4)//2 .. f//2: token 5 reaches frames 10..15
    assert changed.nonzero().flatten().tolist() == list(range(10, 16))


# --- whole encoder ------------------------------------------------------------------------------------------

def test_output_length_and_mask(small):
    n = 7
    tokens, _, emb = random_encoder_inputs(small.config, 3, n, seed=0)
    token_len = torch.tensor([7, 4, 1])
    tokens[1, 4:] = -1
    tokens[2, 1:] = -1
    mu, mask, spks = run(small, tokens, token_len, emb)
    assert mu.shape == (3, 80, 2 * n) and mu.dtype == torch.float32
    assert mask.shape == (3, 1, 2 * n) and mask.dtype == torch.float32
    assert spks.shape == (3, 80)
    expected = torch.zeros(3, 1, 2 * n)
    expected[0, :, :14] = 1
    expected[1, :, :8] = 1
    expected[2, :, :2] = 1
    assert torch.equal(mask, expected)
    assert torch.all(mu[mask.expand_as(mu) == 0] == 0)           # padded frames are zeroed
    assert torch.all(mu[mask.expand_as(mu) == 1].abs().sum() > 0)
    assert torch.isfinite(mu).all()


def test_padded_batch_equals_each_row_alone(small):
    tokens, token_len, emb = random_encoder_inputs(small.config, 4, 23, seed=7)
    token_len[1:] = torch.tensor([15, 3, 22])
    mu, mask, spks = run(small, tokens, token_len, emb)
    for i in range(4):
        n = int(token_len[i])
        mu1, mask1, spks1 = run(small, tokens[i:i + 1, :n], token_len[i:i + 1], emb[i:i + 1])
        assert torch.allclose(mu[i, :, :2 * n], mu1[0], atol=ATOL), i
        assert torch.equal(mask[i, :, :2 * n], mask1[0])
        assert torch.allclose(spks[i], spks1[0], atol=ATOL)
    # what sits in the padding (its id, even out of range) must not matter
    other = tokens.clone()
    pad = ~length_mask(token_len, tokens.shape[1])
    other[pad] = torch.randint(0, 10_000, (int(pad.sum()),))
    assert torch.allclose(run(small, other, token_len, emb)[0], mu, atol=ATOL)


def test_spks_uses_l2_normalised_xvector(small):
    tokens, token_len, emb = random_encoder_inputs(small.config, 2, 5, seed=1)
    _, _, spks = run(small, tokens, token_len, emb)
    _, _, spks_scaled = run(small, tokens, token_len, emb * 37.5)
    assert torch.allclose(spks, spks_scaled, atol=1e-6)
    with torch.no_grad():
        unit = emb / emb.norm(dim=1, keepdim=True)
        assert torch.allclose(spks, small.spk_embed_affine_layer(unit), atol=1e-6)
        assert not torch.allclose(spks, small.spk_embed_affine_layer(emb), atol=1e-3)


def test_last_token_reaches_every_frame(small):
    """Self-attention is over the whole utterance: the lookahead trim is about the lookahead
    convolution's missing right context, not a limited receptive field."""
    tokens, token_len, emb = random_encoder_inputs(small.config, 1, 12, seed=2)
    other = tokens.clone()
    other[0, -1] = (other[0, -1] + 1) % small.config.vocab_size
    diff = (run(small, tokens, token_len, emb)[0] - run(small, other, token_len, emb)[0]).abs().amax(1)[0]
    assert (diff > 1e-6).all()


def test_lookahead_layer_is_used(small):
    tokens, token_len, emb = random_encoder_inputs(small.config, 2, 10, seed=3)
    mu, _, _ = run(small, tokens, token_len, emb)
    zeroed = FlowEncoder(small.config).eval()
    zeroed.load_state_dict(small.state_dict())
    with torch.no_grad():
        zeroed.encoder.pre_lookahead_layer.conv1.weight.zero_()
    mu0, _, _ = run(zeroed, tokens, token_len, emb)
    assert (mu - mu0).abs().max() > 1e-3


def test_too_long_input_is_rejected():
    enc = FlowEncoder(EncoderConfig(**{**EncoderConfig.small().__dict__, "pos_enc_max_len": 16})).eval()
    tokens, token_len, emb = random_encoder_inputs(enc.config, 1, 8, seed=0)
    run(enc, tokens, token_len, emb)  # 16 frames: fits
    tokens, token_len, emb = random_encoder_inputs(enc.config, 1, 9, seed=0)
    with pytest.raises(ValueError, match="pos_enc_max_len"):
        run(enc, tokens, token_len, emb)


# --- ONNX ------------------------------------------------------------------------------------------------

def test_onnx_export_dynamic_shapes_match_torch(small, tmp_path):
    path = export_encoder(small, tmp_path / "encoder.onnx")  # traced at B=2, N=13
    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == list(ENCODER_INPUT_NAMES)
    assert [o.name for o in graph.output] == list(ENCODER_OUTPUT_NAMES)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(graph.input) + list(graph.output)}
    assert dims["tokens"] == ["batch", "tokens"]
    assert dims["mu"] == ["batch", 80, "frames"]
    # runs at B=1, N=7 and B=3, N=23 (padded rows, padding id -1)
    assert check_encoder_onnx(small, path, seed=0) < 1e-4
