"""The voice front-end (s3flow.model.voice): resampler, Kaldi fbank, the two mels, tokenizer, CAMPPlus, embed_ref's rules,
checkpoint layout and input validation.

References, each independent of the code under test:

* figures recorded from torchaudio 2.6 (``functional.resample``, ``compliance.kaldi.fbank``) and librosa 0.11
  (``filters.mel``) on fixed inputs, and the key count and sizes of upstream's ``S3Token2Mel`` modules (recorded in
  a scratch harness beside upstream's code; the whole ``embed_ref`` there matched this port bit for bit on
  perturbed seeded weights at 16, 24 and 44.1 kHz);
* closed forms: the windowed-sinc kernel written from its formula in float64 numpy, a sine resampled against the
  same sine sampled at the new rate, frame and token counts;
* float64 numpy re-implementations of Kaldi fbank and the two mel spectrograms.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from s3flow.model.checkpoint import read_checkpoint
from s3flow.model.checkpoint_io import CheckpointMismatch, save_tensors
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.model.voice import VoiceConfig, VoiceFrontend, VoiceLimits, validate_wav
from s3flow.model.voice.campplus import CAMPPlus, CAMPPlusConfig
from s3flow.model.voice.kaldi_fbank import fbank, mel_banks, num_frames
from s3flow.model.voice.mel import s3gen_mel, slaney_mel_filters, tokenizer_log_mel
from s3flow.model.voice.resample import output_length, resample, sinc_resample_kernel
from s3flow.model.voice.tokenizer import S3TokenizerV2, TokenizerConfig, num_tokens
from s3flow_client.audio import read_wav, write_wav
from s3flow.model.voice.weights import random_voice_state, voice_state_dict



pytestmark = pytest.mark.usefixtures("one_torch_thread")


def chirp(n: int) -> torch.Tensor:
    """The fixed input the recorded torchaudio figures were measured on."""
    k = np.arange(n, dtype=np.float64)
    return torch.from_numpy((0.5 * np.sin(0.003 * k ** 1.5) * np.cos(0.0007 * k)).astype(np.float32))


def speechlike(sr: int, seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(round(sr * seconds))
    t = np.arange(n) / sr
    phase = 2 * np.pi * np.cumsum(120 + 40 * np.sin(2 * np.pi * 0.7 * t)) / sr
    x = sum(np.sin(k * phase) / k for k in range(1, 12)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3.1 * t) ** 2)
    x = 0.2 * x + 0.02 * rng.standard_normal(n)
    return (0.8 * x / np.abs(x).max()).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# resampler

#: torchaudio 2.6 ``transforms.Resample(orig, new)(chirp(2000)[None])`` (upstream's call: float64-built kernel):
#: length, samples [0, 1, 17, 100, 333, -1], sum. ``functional.resample`` on float32 input builds its kernel in
#: float32 and differs by up to 1.8e-6 (0.4502271 at [100] for 44.1 -> 16 kHz): the tolerance tells them apart.
TORCHAUDIO_RESAMPLE = {
    (44100, 16000): (726, [0.0002668, 0.0067715, 0.4101815, 0.4502253, 0.3946016, -0.0615706], 6.883557),
    (16000, 24000): (3000, [2.8e-06, 0.0008176, 0.0571526, 0.4988213, -0.236137, -0.0530001], 28.446056),
    (48000, 24000): (1000, [0.000153, 0.0041881, 0.2802011, 0.3998092, 0.4300101, -0.0717012], 9.499326),
    (22050, 16000): (1452, [6.77e-05, 0.0024039, 0.1668896, -0.4929442, -0.4454766, -0.0292365], 13.757371),
}


@pytest.mark.parametrize("rates", list(TORCHAUDIO_RESAMPLE))
def test_resample_matches_recorded_torchaudio(rates):
    length, samples, total = TORCHAUDIO_RESAMPLE[rates]
    y = resample(chirp(2000)[None], *rates)[0]
    assert y.shape[0] == length
    np.testing.assert_allclose(y[[0, 1, 17, 100, 333, -1]].numpy(), samples, rtol=0, atol=1.5e-7)
    assert abs(float(y.double().sum()) - total) < 2e-6


def test_resample_identity_and_lengths():
    x = chirp(1234)[None]
    assert resample(x, 24000, 24000) is x
    for orig, new in [(44100, 16000), (44100, 24000), (8000, 24000), (48000, 16000), (11025, 16000)]:
        for n in (1, 7, 441, 1000, 44101):
            expected = math.ceil(n * new / orig - 1e-12)
            assert output_length(n, orig, new) == expected
            assert resample(torch.zeros(2, n), orig, new).shape == (2, expected)


@pytest.mark.parametrize("orig,new", [(44100, 16000), (16000, 24000), (22050, 24000)])
def test_resample_kernel_is_the_windowed_sinc(orig, new):
    kernel, width = sinc_resample_kernel(orig, new)
    g = math.gcd(orig, new)
    o, m = orig // g, new // g
    fc = min(o, m) * 0.99
    assert width == math.ceil(6 * o / fc) and kernel.shape == (m, 1, 2 * width + o)
    j = (-np.arange(m, dtype=np.int64) / m).astype(np.float32).astype(np.float64)  # phases in float32, as defined
    t = np.clip((j[:, None] + (np.arange(-width, width + o) / o)[None]) * fc, -6, 6)
    h = np.sinc(t) * np.cos(np.pi * t / 12) ** 2 * fc / o
    np.testing.assert_allclose(kernel[:, 0].numpy(), h, atol=1e-7)
    # one phase alone is the polyphase definition: output j at input offset width sees kernel row j
    assert abs(kernel[0, 0, width].item() - fc / o) < 1e-7


def test_resample_keeps_in_band_sines_and_removes_aliases():
    orig, new = 44100, 16000
    t = np.arange(orig * 1) / orig
    y = resample(torch.from_numpy(np.sin(2 * np.pi * 1000 * t).astype(np.float32))[None], orig, new)[0].numpy()
    ref = np.sin(2 * np.pi * 1000 * np.arange(y.size) / new)
    interior = slice(100, -100)
    assert np.abs(y[interior] - ref[interior]).max() < 2e-3          # measured 4.0e-4
    alias = resample(torch.from_numpy(np.sin(2 * np.pi * 10000 * t).astype(np.float32))[None], orig, new)[0]
    assert alias[100:-100].abs().max() < 0.02                         # measured 5.4e-3: 10 kHz > new Nyquist


# ---------------------------------------------------------------------------------------------------------------
# Kaldi fbank


def numpy_kaldi_fbank(x: np.ndarray, bins: int = 80) -> np.ndarray:
    """Kaldi's compute-fbank-feats, written out in float64 (16 kHz, 25/10 ms, povey, pre-emphasis 0.97)."""
    x = x.astype(np.float64)
    m = 1 + (x.size - 400) // 160
    frames = np.stack([x[i * 160:i * 160 + 400] for i in range(m)])
    frames = frames - frames.mean(1, keepdims=True)
    frames = frames - 0.97 * np.concatenate([frames[:, :1], frames[:, :-1]], 1)
    frames = frames * (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 399)) ** 0.85
    power = np.abs(np.fft.rfft(frames, 512)) ** 2
    mel = lambda f: 1127.0 * np.log(1.0 + f / 700.0)  # noqa: E731
    edges = mel(20.0) + np.arange(bins + 2) * (mel(8000.0) - mel(20.0)) / (bins + 1)
    fm = mel(16000 / 512 * np.arange(257))
    banks = np.maximum(0, np.minimum((fm - edges[:-2, None]) / (edges[1:-1, None] - edges[:-2, None]),
                                     (edges[2:, None] - fm) / (edges[2:, None] - edges[1:-1, None])))
    banks[:, 256] = 0
    return np.log(np.maximum(power @ banks.T, np.finfo(np.float32).eps))


def test_fbank_matches_recorded_torchaudio_and_float64_kaldi():
    f = fbank(chirp(2000))
    assert f.shape == (11, 80)
    assert abs(float(f.double().sum()) - (-11399.977)) < 0.05          # torchaudio 2.6: -11399.977
    assert abs(f[0, 0].item() - (-3.24113)) < 1e-4
    x = speechlike(16000, 1.3)
    ours = fbank(torch.from_numpy(x)).numpy()
    ref = numpy_kaldi_fbank(x)
    assert ours.shape == ref.shape == (num_frames(x.size), 80)
    assert np.abs(ours - ref).max() < 2e-3                            # float32 vs float64 (measured 1e-4)


def test_fbank_frames_and_banks():
    assert [num_frames(n) for n in (399, 400, 559, 560, 16000)] == [0, 1, 1, 2, 98]
    with pytest.raises(ValueError, match="at least 400 samples"):
        fbank(torch.zeros(399))
    banks = mel_banks(80, 512, 16000.0)
    assert banks.shape == (80, 257) and float(banks[:, -1].abs().max()) == 0.0
    assert float(banks[:, 0].abs().max()) == 0.0                     # 0 Hz is below the 20 Hz low edge
    peaks = banks.argmax(1)
    assert bool((peaks[1:] >= peaks[:-1]).all()) and float(banks.max()) <= 1.0


# ---------------------------------------------------------------------------------------------------------------
# mel spectrograms


def test_slaney_filters_match_recorded_librosa():
    m1 = slaney_mel_filters(24000, 1920, 80, 0.0, 8000.0)
    assert m1.shape == (80, 961) and abs(float(m1.sum()) - 6.3998918533325195) < 1e-5
    assert abs(float(m1[79].max()) - 0.0033656926825642586) < 1e-9
    m2 = slaney_mel_filters(16000, 400, 128)
    assert m2.shape == (128, 201) and abs(float(m2.sum()) - 3.1909854412078857) < 1e-5
    assert abs(float(m2[127, 195]) - 0.005041601601988077) < 1e-9
    assert abs(float(m2[0, 1]) - 0.012373986653983593) < 1e-9


def test_s3gen_mel_against_float64_numpy():
    x = speechlike(24000, 1.01)
    mel = s3gen_mel(torch.from_numpy(x)[None])[0].numpy()
    assert mel.shape == (80, x.size // 480)
    padded = np.pad(x.astype(np.float64), 720, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(1920) / 1920)           # periodic Hann
    frames = np.stack([padded[i * 480:i * 480 + 1920] for i in range(x.size // 480)]) * window
    mag = np.sqrt(np.abs(np.fft.rfft(frames)) ** 2 + 1e-9)
    ref = np.log(np.maximum(slaney_mel_filters(24000, 1920, 80, 0.0, 8000.0).double().numpy() @ mag.T, 1e-5))
    assert np.abs(mel - ref).max() < 1e-3
    silent = s3gen_mel(torch.zeros(1, 4800))
    assert float(silent.max()) == pytest.approx(math.log(1e-5), abs=1e-6)  # floor, not log(0)


def test_tokenizer_log_mel_against_float64_numpy():
    x = speechlike(16000, 1.0) * np.linspace(1.0, 1e-4, 16000).astype(np.float32)   # > 80 dB of range
    mel = tokenizer_log_mel(torch.from_numpy(x)).numpy()
    assert mel.shape == (128, x.size // 160)
    padded = np.pad(x.astype(np.float64), 200, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 400)
    frames = np.stack([padded[i * 160:i * 160 + 400] for i in range(x.size // 160)]) * window
    log_spec = np.log10(np.maximum(slaney_mel_filters(16000, 400, 128).double().numpy()
                                   @ (np.abs(np.fft.rfft(frames)) ** 2).T, 1e-10))
    ref = (np.maximum(log_spec, log_spec.max() - 8.0) + 4.0) / 4.0
    assert np.abs(mel - ref).max() < 1e-3
    assert mel.max() - mel.min() == pytest.approx(2.0, abs=1e-5)          # the floor at max - 8 (in log10) bites


# ---------------------------------------------------------------------------------------------------------------
# networks, embed_ref's rules, checkpoints


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("voice") / "s3gen.safetensors", FlowConfig.small(),
                                   seed=4, vocoder=True)


@pytest.fixture(scope="module")
def frontend(small_ckpt):
    return VoiceFrontend.from_checkpoint(small_ckpt)


def test_whole_upstream_layout_loads(small_ckpt, tmp_path):
    from safetensors import safe_open
    with safe_open(str(small_ckpt), "pt") as f:
        keys = list(f.keys())
    assert {k.split(".")[0] for k in keys} == {"flow", "tokenizer", "speaker_encoder", "mel2wav"}
    flow_only = write_random_checkpoint(tmp_path / "flow.safetensors", FlowConfig.small(), seed=4, voice=False)
    a, _ = read_checkpoint(flow_only)
    b, _ = read_checkpoint(small_ckpt)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)      # flow.* unchanged
    # same weights as the seeded random modules; the front-end gives the same prompt from either
    fresh = VoiceFrontend.random(VoiceConfig.small(), seed=4)
    loaded = VoiceFrontend.from_checkpoint(small_ckpt)
    wav = speechlike(16000, 1.5)
    p, q = fresh.embed(wav, 16000), loaded.embed(wav, 16000)
    assert np.array_equal(p.prompt_tokens, q.prompt_tokens) and np.array_equal(p.embedding, q.embedding)


def test_checkpoint_mismatches_are_reported(small_ckpt, tmp_path):
    state = random_voice_state(VoiceConfig.small(), seed=1)
    # upstream's unstored buffers are accepted and ignored
    extra = dict(state, **{"tokenizer._mel_filters": torch.zeros(128, 201), "tokenizer.window": torch.zeros(400)})
    VoiceFrontend.from_checkpoint(save_tensors(extra, tmp_path / "extra.safetensors", {}), VoiceConfig.small())
    no_speaker = {k: v for k, v in state.items() if k.startswith("tokenizer.")}
    with pytest.raises(CheckpointMismatch, match="speaker_encoder"):
        VoiceFrontend.from_checkpoint(save_tensors(no_speaker, tmp_path / "ns.safetensors", {}))
    with pytest.raises(CheckpointMismatch, match="shape mismatches"):   # no metadata: full size expected
        VoiceFrontend.from_checkpoint(save_tensors(state, tmp_path / "small_as_full.safetensors", {}))
    pt = tmp_path / "s3gen.pt"
    torch.save(state, pt)
    VoiceFrontend.from_checkpoint(pt, VoiceConfig.small())


def test_full_size_key_layout_matches_upstream():
    """Key count and tensor sizes of upstream's S3Token2Mel.tokenizer / .speaker_encoder (recorded)."""
    sd = voice_state_dict(S3TokenizerV2(TokenizerConfig.full()), CAMPPlus(CAMPPlusConfig.full()))
    tok = {k: v for k, v in sd.items() if k.startswith("tokenizer.")}
    spk = {k: v for k, v in sd.items() if k.startswith("speaker_encoder.")}
    assert len(tok) == 104 - 2 and sum(v.numel() for v in tok.values()) == 123740696 - 128 * 201 - 400
    assert len(spk) == 937
    assert sum(v.numel() for k, v in spk.items() if not k.endswith("num_batches_tracked")) == 6930720
    for key in ("tokenizer.encoder.blocks.5.attn.fsmn_block.weight", "tokenizer.quantizer._codebook.project_down.bias",
                "speaker_encoder.xvector.block2.tdnnd24.cam_layer.linear_local.weight",
                "speaker_encoder.head.layer2.0.shortcut.1.running_var",
                "speaker_encoder.xvector.dense.nonlinear.batchnorm.running_mean"):
        assert key in sd, key
    assert "tokenizer.encoder.blocks.0.attn.key.bias" not in sd


@pytest.mark.parametrize("sr", [16000, 24000, 44100])
def test_embed_ref_shapes_and_token_cut(frontend, sr):
    for seconds in (1.53, 2.0, 2.3):     # 1.53 and 2.3 s are not whole 40 ms token hops
        wav = speechlike(sr, seconds)
        p = frontend.embed(wav, sr)
        n16, n24 = output_length(wav.size, sr, 16000), output_length(wav.size, sr, 24000)
        t, raw = n24 // 480, num_tokens(n16)
        assert p.prompt_feat.shape == (1, t, 80) and p.prompt_feat.dtype == np.float32
        assert p.embedding.shape == (1, 192) and p.embedding.dtype == np.float32
        assert p.prompt_tokens.dtype == np.int64
        expected = raw if t == 2 * raw else t // 2
        assert p.prompt_tokens.shape == (1, expected), (seconds, t, raw)
        uncut = frontend.tokenizer.tokenize(resample(torch.from_numpy(wav)[None], sr, 16000)[0])
        assert uncut.shape[1] == raw and np.array_equal(p.prompt_tokens, uncut[:, :expected].numpy())
        a = p.aligned()
        assert a.prompt_feat.shape == (1, 2 * expected, 80) and np.array_equal(a.prompt_feat,
                                                                                p.prompt_feat[:, :2 * expected])
        assert ((p.prompt_tokens >= 0) & (p.prompt_tokens < 6561)).all()
    assert frontend.embed(speechlike(sr, 2.0), sr).prompt_tokens.shape == (1, 50)     # whole hops: no cut
    assert frontend.embed(speechlike(sr, 1.53), sr).prompt_tokens.shape == (1, 38)    # 39 tokens cut to 76 // 2


def test_embed_ref_steps_are_the_parts(frontend):
    wav = speechlike(44100, 1.7, seed=3)
    p = frontend.embed(wav, 44100)
    x = torch.from_numpy(wav)[None]
    feat = s3gen_mel(resample(x, 44100, 24000)).transpose(1, 2)
    assert np.array_equal(p.prompt_feat, feat.numpy())
    w16 = resample(x, 44100, 16000)[0]
    f = fbank(w16)
    xvec = frontend.speaker_encoder((f - f.mean(0, keepdim=True))[None])
    assert np.array_equal(p.embedding, xvec.detach().numpy())
    # the outputs follow the input: another voice gives another embedding and other tokens
    q = frontend.embed(speechlike(44100, 1.7, seed=9) * 0.3, 44100)
    assert np.abs(q.embedding - p.embedding).max() > 0.1 and (q.prompt_tokens != p.prompt_tokens).mean() > 0.2


# ---------------------------------------------------------------------------------------------------------------
# bad audio

GOOD = speechlike(16000, 1.5)


@pytest.mark.parametrize("wav,sr,message", [
    (np.zeros(0, np.float32), 16000, r"wav is empty \(0 samples\)"),
    (GOOD[:15999], 16000, r"too short: 1\.000 s \(15999 samples at 16000 Hz\), at least 1 s"),
    (np.tile(GOOD, 14), 16000, r"too long: 21\.000 s \(336000 samples at 16000 Hz\), at most 20 s"),
    (np.where(np.arange(GOOD.size) == 777, np.nan, GOOD).astype(np.float32), 16000,
     r"1 NaN or Inf samples \(first at sample 777: nan\)"),
    (np.where(np.arange(GOOD.size) >= 5, np.inf, GOOD).astype(np.float32), 16000, r"23995 NaN or Inf samples"),
    (np.stack([GOOD, GOOD], 1), 16000, r"mono.*got shape \[24000, 2\]"),
    (GOOD[None], 16000, r"mono.*got shape \[1, 24000\]"),
    ((GOOD * 32767).astype(np.int16), 16000, r"integer PCM of dtype int16"),
    (GOOD, 44000, r"unsupported sample_rate 44000 Hz"),
    (GOOD, 16000.0, r"sample_rate must be an integer number of Hz, got 16000\.0"),
    (GOOD, True, r"sample_rate must be an integer number of Hz, got True"),
    (np.zeros(24000, np.float32), 16000, r"silent: peak \|sample\| 0 is below 0\.001"),
    (GOOD * 1e-4, 16000, r"silent: peak \|sample\| 8e-05"),
    (GOOD * 32767, 16000, r"peak \|sample\| 26213\.6 is above 2"),
    (GOOD.astype(np.complex64), 16000, r"float samples in \[-1, 1\], got dtype complex64"),
])
def test_bad_audio_is_refused_with_the_value(wav, sr, message):
    with pytest.raises(ValueError, match=message):
        validate_wav(wav, sr)


def test_good_audio_passes_and_limits_are_settings(frontend):
    out = validate_wav(GOOD.astype(np.float64), np.int64(16000))
    assert out.dtype == np.float32 and out.shape == GOOD.shape
    validate_wav(torch.from_numpy(GOOD), 16000)
    with pytest.raises(ValueError, match="at most 1.2 s"):
        validate_wav(GOOD, 16000, VoiceLimits(max_seconds=1.2))
    with pytest.raises(ValueError, match="too short"):
        frontend.embed(GOOD[:8000], 16000)


def test_wav_files_round_trip(tmp_path):
    x = speechlike(22050, 1.2)
    y, rate = read_wav(write_wav(tmp_path / "a.wav", x, 22050))
    assert rate == 22050 and y.shape == x.shape and np.abs(y - x).max() <= 1 / 32768 + 1e-7
    z, _ = read_wav(write_wav(tmp_path / "b.wav", np.stack([x, -x], 1), 22050, float32=True))
    assert z.shape == (x.size, 2) and np.array_equal(z[:, 0], x)
    (tmp_path / "c.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVX")
    with pytest.raises(ValueError, match="not a readable audio file"):
        read_wav(tmp_path / "c.wav")


def test_embed_voice_script_writes_what_embed_ref_returns(small_ckpt, frontend, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "embed_voice.py"
    wav = speechlike(44100, 1.37)
    write_wav(tmp_path / "ref.wav", wav, 44100, float32=True)
    r = subprocess.run([sys.executable, str(script), "--checkpoint", str(small_ckpt), "--wav",
                        str(tmp_path / "ref.wav"), "--output", str(tmp_path / "v.npz"), "--threads", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out, p = np.load(tmp_path / "v.npz"), frontend.embed(wav, 44100)
    for name, value in p.as_dict().items():
        assert out[name].dtype == value.dtype and np.array_equal(out[name], value), name
    write_wav(tmp_path / "short.wav", wav[:30000], 44100)
    r = subprocess.run([sys.executable, str(script), "--checkpoint", str(small_ckpt), "--wav",
                        str(tmp_path / "short.wav"), "--output", str(tmp_path / "s.npz")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "too short: 0.680 s (30000 samples at 44100 Hz)" in r.stderr
