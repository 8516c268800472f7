"""scripts/vocode.py and the vocoder's noise-free source (issue 13 item 5).

The noise-free source reproduces upstream ``SineGen`` on CPU: float32 increments, a running phase summed in float64
and rounded to float32 per sample. Checked here against a float64 closed form (the phase of a held F0 is linear in
the sample index) and against the float32 running sum that it must not be; the whole noise-free vocoder matched
upstream's ``HiFTGenerator.inference`` (zero phases, zero noise) to 2e-6 relative on the same torch version in a
scratch harness (not committed: it needs upstream's source and torchaudio).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from s3flow.model.vocoder import VocoderConfig, random_vocoder, upstream_harmonics, write_vocoder_checkpoint
from s3flow.model.vocoder_source import SourceParams

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_noise_free_phase_is_the_float64_sum_rounded_per_sample():
    p = SourceParams()
    f0 = torch.tensor([[0.0, 5.0, 173.3, 173.3, 251.9] * 40], dtype=torch.float32)   # 200 frames, 4 s
    h = upstream_harmonics(f0, p)[0].double().numpy()                                 # (9, 96000)
    inc = (f0.repeat_interleave(p.hop_samples, -1)[0].numpy()[None, :]
           * np.arange(1, 10, dtype=np.float32)[:, None] / np.float32(p.sampling_rate)).astype(np.float32)
    exact = np.cumsum(inc.astype(np.float64), axis=1)
    voiced = np.repeat(f0[0].numpy() > p.nsf_voiced_threshold, p.hop_samples)[None]
    ref = np.where(voiced, p.nsf_alpha * np.sin(2 * np.pi * (exact.astype(np.float32) % 1)), 0.0)
    assert np.abs(h - ref).max() < 2e-6                                     # float32 sin and 2 pi only
    assert (h[:, ~voiced[0]] == 0).all()                                    # unvoiced: no sine, no noise
    drift = np.cumsum(inc, axis=1, dtype=np.float32)                        # a float32 running sum
    wrong = np.where(voiced, p.nsf_alpha * np.sin(2 * np.pi * (drift % 1)), 0.0)
    assert np.abs(wrong - ref).max() > 1e-3                                 # ... is off by far more


def test_vocode_script_noise_free_is_deterministic_and_the_default_is_seeded(tmp_path):
    hift = random_vocoder(VocoderConfig.small(), seed=3)
    ckpt = write_vocoder_checkpoint(hift, tmp_path / "hift.safetensors")
    mel = np.random.default_rng(0).normal(-6.0, 1.5, (1, 80, 40)).astype(np.float32)
    np.savez(tmp_path / "mel.npz", mel=mel)

    def run(name, *extra):
        out = tmp_path / f"{name}.npz"
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "vocode.py"), "--checkpoint", str(ckpt),
                            "--mel", str(tmp_path / "mel.npz"), "--output", str(out), "--threads", "1", *extra],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return np.load(out)["audio"]

    a, b = run("a", "--noise-free"), run("b", "--noise-free", "--seed", "5")
    assert a.shape == (1, 480 * 40) and np.array_equal(a, b)               # no randomness left
    with torch.inference_mode():
        m = torch.from_numpy(mel)
        expected = hift(m, upstream_harmonics(hift.f0_predictor(m), hift.source_params)).numpy()
    np.testing.assert_allclose(a, expected, rtol=0, atol=1e-6)
    s0 = run("s0")
    assert np.abs(s0 - a).max() > 1e-4                                     # default: the seeded source
    np.testing.assert_allclose(s0, hift.inference(torch.from_numpy(mel), seed=0)[0].numpy(), rtol=0, atol=1e-6)
    np.savez(tmp_path / "bad.npz", mel=mel[:, :79])
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "vocode.py"), "--checkpoint", str(ckpt), "--mel",
                        str(tmp_path / "bad.npz"), "--output", str(tmp_path / "x.npz")], capture_output=True, text=True)
    assert r.returncode == 2 and "mel must have shape (1, 80, T >= 1), got [1, 79, 40]" in r.stderr
