"""The whole flow in process: checkpoints, conditioning, padded batches, not-finalised inference, flow_infer."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import small_flow
from s3flow.model.checkpoint import flow_state_dict, is_meanflow, load_flow, read_checkpoint, write_checkpoint
from s3flow.model.checkpoint_io import CheckpointMismatch
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.chunks import condition, solve_frames
from s3flow.model.flow import FlowConfig, S3Flow, synthesize
from s3flow.model.solver import CountingEstimator
from s3flow.model.flow import TorchEstimator

ROOT = Path(__file__).resolve().parents[1]


def inputs(b=1, n=20, np_=10, seed=0, n_feats=80):
    g = torch.Generator().manual_seed(seed)
    return dict(speech_tokens=torch.randint(0, 6561, (b, n), generator=g),
                prompt_tokens=torch.randint(0, 6561, (1, np_), generator=g),
                prompt_feat=torch.randn(1, 2 * np_, n_feats, generator=g) - 3,
                embedding=torch.randn(1, 192, generator=g))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("meanflow", [False, True])
def test_checkpoint_round_trip(tmp_path, suffix, meanflow):
    flow = small_flow(meanflow)
    path = write_checkpoint(flow, tmp_path / f"s3gen{suffix}")
    state, config = read_checkpoint(path)
    assert is_meanflow(state) == meanflow and config.meanflow == meanflow
    loaded = load_flow(path)
    for k, v in flow_state_dict(flow).items():
        assert torch.equal(flow_state_dict(loaded)[k], v), k
    a = synthesize(flow, **inputs(), seed=1, n_steps=2).mel
    b = synthesize(loaded, **inputs(), seed=1, n_steps=2).mel
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_random_checkpoint_perturbs_biases_norms_and_mixer():
    flow = small_flow(True)
    sd = flow_state_dict(flow)
    mixer = sd["flow.decoder.estimator.time_embed_mixer.weight"]
    d = mixer.shape[0]
    assert not torch.allclose(mixer[:, :d], torch.eye(d)) and mixer[:, d:].abs().max() > 0
    norm_w = [v for k, v in sd.items() if k.endswith("norm1.weight")]
    assert norm_w and all(not torch.allclose(w, torch.ones_like(w)) for w in norm_w)
    biases = [v for k, v in sd.items() if k.endswith(".bias")]
    assert all(v.abs().max() > 0 for v in biases)


def test_mismatch_lists_missing_and_unexpected_keys(tmp_path):
    flow = small_flow()
    state = {k: v.clone() for k, v in flow_state_dict(flow).items()}
    del state["flow.encoder_proj.weight"]
    state["flow.decoder.estimator.bogus.weight"] = torch.zeros(1)
    state["flow.input_embedding.weight"] = torch.zeros(3, 3)
    from safetensors.torch import save_file
    import json
    save_file(state, str(tmp_path / "bad.safetensors"),
              metadata={"s3flow_config": json.dumps(flow.config.to_dict())})
    with pytest.raises(CheckpointMismatch) as info:
        load_flow(tmp_path / "bad.safetensors")
    msg = str(info.value)
    assert "missing keys (1):\n  flow.encoder_proj.weight" in msg
    assert "unexpected keys (1):\n  flow.decoder.estimator.bogus.weight" in msg
    assert "flow.input_embedding.weight: checkpoint (3, 3) vs model (6561, 64)" in msg


def test_upstream_checkpoint_without_our_metadata_loads_as_full_size(tmp_path):
    """A real s3gen checkpoint has no config metadata and other modules beside flow.*: it must load
    as the full-size config, meanflow detected from the mixer, other modules ignored."""
    with torch.device("meta"):
        flow = S3Flow(FlowConfig.full(meanflow=True))
    state = {k: torch.zeros(v.shape) for k, v in flow_state_dict(flow).items()}
    state["mel2wav.conv_pre.bias"] = torch.zeros(4)
    torch.save(state, tmp_path / "s3gen.pt")
    loaded = load_flow(tmp_path / "s3gen.pt")
    assert loaded.config.meanflow and loaded.config == FlowConfig.full(meanflow=True)


@pytest.mark.fullsize
def test_full_size_key_set_and_shapes_match_upstream_layout():
    with torch.device("meta"):
        regular, mf = S3Flow(FlowConfig.full()), S3Flow(FlowConfig.full(meanflow=True))
    sd = {k: tuple(v.shape) for k, v in flow_state_dict(regular).items()}
    assert sd["flow.decoder.estimator.mid_blocks.11.1.3.ff.net.2.weight"] == (256, 1024)
    assert sd["flow.decoder.estimator.mid_blocks.3.1.2.attn1.to_q.weight"] == (512, 256)
    assert sd["flow.decoder.estimator.down_blocks.0.0.block1.block.0.weight"] == (256, 320, 3)
    assert sd["flow.input_embedding.weight"] == (6561, 512)
    assert sd["flow.spk_embed_affine_layer.weight"] == (80, 192)
    assert sd["flow.encoder_proj.weight"] == (80, 512)
    assert any(k.startswith("flow.encoder.up_encoders.3.") for k in sd)
    assert any(k.startswith("flow.encoder.encoders.5.") for k in sd)
    assert any(k.startswith("flow.encoder.pre_lookahead_layer.") for k in sd)
    assert "flow.decoder.estimator.time_embed_mixer.weight" not in sd
    assert flow_state_dict(mf)["flow.decoder.estimator.time_embed_mixer.weight"].shape == (1024, 2048)
    n = lambda m: sum(p.numel() for p in m.parameters())
    assert n(regular.estimator) == 71_302_480 and n(mf.estimator) == 73_399_632
    assert 112.0e6 < n(regular) < 113.0e6


def test_padded_batch_equals_one_at_a_time():
    """B utterances of different lengths, padded and masked, give each one's own mel (tolerance 1e-4)."""
    flow = small_flow()
    base = inputs(b=1, n=30)
    lens = [30, 17, 24]
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 6561, (3, 30), generator=g)
    for i, n in enumerate(lens):
        rows[i, n:] = 0
    batch = synthesize(flow, rows, base["prompt_tokens"], base["prompt_feat"], base["embedding"],
                       speech_token_len=torch.tensor(lens), seed=[3, 4, 5], n_steps=3)
    assert batch.lengths.tolist() == [2 * n for n in lens]
    for i, n in enumerate(lens):
        one = synthesize(flow, rows[i:i + 1, :n], base["prompt_tokens"], base["prompt_feat"], base["embedding"],
                         seed=3 + i, n_steps=3)
        torch.testing.assert_close(batch.mel[i, :, :2 * n], one.mel[0], rtol=0, atol=1e-4)
        assert torch.all(batch.mel[i, :, 2 * n:] == 0)


def test_not_finalised_drops_exactly_six_frames_and_builds_mask_from_trimmed_length():
    flow = small_flow()
    x = inputs(b=2, n=25)
    fin = synthesize(flow, **x, seed=0, n_steps=2)
    part = synthesize(flow, **x, seed=0, n_steps=2, finalize=False)
    assert fin.mel.shape[-1] == 50 and part.mel.shape[-1] == 44
    assert part.lengths.tolist() == [44, 44]
    # the condition: mask length = trimmed frames (the reference builds it untrimmed and crashes)
    tokens = torch.cat([x["prompt_tokens"], x["speech_tokens"][:1]], 1)
    mu, mask, spks = flow.encoder(tokens, torch.tensor([tokens.shape[1]]), x["embedding"])
    lengths = solve_frames(torch.tensor([tokens.shape[1]]), 20, finalize=False)
    c = condition(mu, spks, lengths, [x["prompt_feat"][0].T])
    assert c.mu.shape[-1] == c.mask.shape[-1] == c.cond.shape[-1] == 2 * 35 - 6
    torch.testing.assert_close(c.cond[0, :, :20], x["prompt_feat"][0].T)
    assert torch.all(c.cond[0, :, 20:] == 0)


def test_explicit_z_is_used_bit_for_bit_and_wrong_shape_is_an_error():
    flow = small_flow()
    x = inputs(b=1, n=10)
    z = torch.randn(1, 80, 40, generator=torch.Generator().manual_seed(9))
    counted = CountingEstimator(TorchEstimator(flow.estimator))
    a = synthesize(flow, **x, z=z, n_steps=4, estimator=counted)
    assert counted.nfe == 4
    b = synthesize(flow, **x, z=z.clone(), n_steps=4)
    assert torch.equal(a.mel, b.mel)
    c = synthesize(flow, **x, z=z + 0.1, n_steps=4)
    assert not torch.allclose(a.mel, c.mel)
    with pytest.raises(ValueError, match=r"z must have shape \(1, 80, 40\)"):
        synthesize(flow, **x, z=z[..., :-1])


def test_flow_infer_command(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "s3gen.safetensors", FlowConfig.small(), seed=2)
    run = lambda *a: subprocess.run([sys.executable, str(ROOT / "scripts" / "flow_infer.py"), *map(str, a)],
                                    capture_output=True, text=True, timeout=300)
    r = run("--make-example", tmp_path / "in.npz")
    assert r.returncode == 0, r.stderr
    r = run("--checkpoint", ckpt, "--inputs", tmp_path / "in.npz", "--output", tmp_path / "out.npz")
    assert r.returncode == 0, r.stderr
    d, mel = np.load(tmp_path / "in.npz"), np.load(tmp_path / "out.npz")["mel"]
    assert mel.shape == (1, 80, 100)
    want = synthesize(load_flow(ckpt), torch.from_numpy(d["speech_tokens"]), torch.from_numpy(d["prompt_tokens"]),
                      torch.from_numpy(d["prompt_feat"]), torch.from_numpy(d["embedding"]),
                      z=torch.from_numpy(d["z"]), n_steps=int(d["n_timesteps"])).mel.numpy()
    np.testing.assert_array_equal(mel, want)
    # a z of the wrong length is refused with a clear message
    bad = dict(d)
    bad["z"] = d["z"][..., :-2]
    np.savez(tmp_path / "bad.npz", **bad)
    r = run("--checkpoint", ckpt, "--inputs", tmp_path / "bad.npz", "--output", tmp_path / "o2.npz")
    assert r.returncode == 2 and "z must have shape" in r.stderr
