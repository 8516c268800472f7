"""The HiFT vocoder: checkpoint names, ONNX parity, streaming that equals offline vocoding, served token2wav.

Small configs throughout (``VocoderConfig.small()`` keeps every stride, kernel and receptive field of the
full vocoder and narrows the channels). Every comparison is against a second code path: torch.stft /
torch.istft for the convolutional STFT, torch for ONNX Runtime, one offline pass over the whole mel for
the streamed audio, chunk-by-chunk vocoding without state for the seam check.

Stated tolerances (measured figures in comments; the signal's std is about 0.03):

* streamed vs offline, in process (torch) and served (vs the same ONNX graphs offline): max abs 1e-6
  (measured 1.4e-7 and 9e-8: float32 rounding of the decoder on different window lengths; F0 runs in
  float64 so that the source's phase, which integrates it, does not drift);
* seams: at every seam the sample-to-sample jump differs from offline's jump there by at most 1e-6, and is
  no larger than the largest jump elsewhere;
* torch vs ONNX Runtime: 1e-5 on audio, 1e-9 Hz on F0.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from s3flow.model.checkpoint import flow_state_dict, load_flow
from s3flow.model.checkpoint_io import CheckpointMismatch, save_tensors
from s3flow.model.random_checkpoint import random_flow
from s3flow.model.flow import FlowConfig
from s3flow.engine.sequences import SequenceLimits, SequenceTable
from s3flow.engine.settings import SolverSettings
from s3flow.engine.vocoder_stream import F0_LOOKAHEAD_FRAMES, StreamError, StreamSettings, VocoderStream
from s3flow.model.vocoder import (HiFTGenerator, VocoderConfig, hann_window, load_vocoder, random_vocoder,
                                  vocoder_state_dict, write_vocoder_checkpoint)
from s3flow.model.vocoder_source import HOP_SAMPLES, Excitation, harmonic_source, offline_vocode, trim_fade
from s3flow.runtime.torch_vocoder import TorchVocoder
from s3flow.runtime.vocoder import check_vocoder_onnx, export_vocoder, vocode
from s3flow.runtime.vocoder_runner import OnnxVocoder

SMALL = VocoderConfig.small()
STREAM_TOL = 1e-6
SERVED_TOL = 1e-6


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Small convolutions gain nothing from threads, and on a shared 2-core host a second OpenMP thread
    made them 20x slower; restored for the other modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=2)
def small_vocoder(seed: int = 3) -> HiFTGenerator:
    return random_vocoder(SMALL, seed=seed)


@functools.lru_cache(maxsize=2)
def small_runner(seed: int = 3) -> TorchVocoder:
    return TorchVocoder(small_vocoder(seed))


def torch_vocode(mel, seed):
    """Offline vocoding with the small vocoder (``vocode`` over a cached, weight-norm-folded copy)."""
    runner = small_runner()
    return offline_vocode(runner.f0, runner.decode, mel, runner.hift.source_params, seed=seed)


def stand_in_mel(frames: int, seed: int = 0) -> np.ndarray:
    """(80, frames) log-mel-like values, smooth over time like real mel."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((80, frames + 4))
    x = (x[:, :-4] + x[:, 1:-3] + x[:, 2:-2] + x[:, 3:-1] + x[:, 4:]) / np.sqrt(5)
    return (-4.0 + 1.5 * x).astype(np.float32)


def stream_in_process(runner, hift, mel, sizes, seed=0, **settings):
    """Push mel in chunks of ``sizes`` frames; return (audio, sample offsets of the chunks, stream)."""
    vs = VocoderStream(runner.f0, runner.decode, hift.source_params, StreamSettings(**settings))
    state, parts, offsets, at = vs.start(seed), [], [], 0
    for i, n in enumerate(sizes):
        state, chunk = vs.push(state, mel[:, at:at + n], at, end=i == len(sizes) - 1)
        assert chunk.sample_offset == sum(p.size for p in parts), "sample offsets must continue"
        parts.append(chunk.audio)
        offsets.append(chunk.sample_offset)
        at += n
    return np.concatenate(parts), offsets, vs


def seam_report(audio: np.ndarray, ref: np.ndarray, seams) -> dict:
    """Sample-to-sample jumps at the seams (the step into each seam's first sample) against the rest."""
    seams = np.array([s for s in seams if 0 < s < audio.size], dtype=int)
    jump, ref_jump = np.diff(audio), np.diff(ref)
    at = seams - 1
    away = np.ones(jump.size, bool)
    away[at] = False
    return {"seam_jump": float(np.abs(jump[at]).max()) if at.size else 0.0,
            "jump_elsewhere": float(np.abs(jump[away]).max()),
            "seam_excess": float(np.abs(jump[at] - ref_jump[at]).max()) if at.size else 0.0,
            "seam_error": float(max(np.abs(audio[max(s - 240, 0):s + 240] - ref[max(s - 240, 0):s + 240]).max()
                                    for s in seams)) if seams.size else 0.0}


# ---------------------------------------------------------------------------------------------------
# The network


def test_conv_stft_and_istft_match_torch():
    hift = small_vocoder()
    x = torch.randn(2, 480 * 7, generator=torch.Generator().manual_seed(0))
    window = hann_window(16).float()
    ref = torch.view_as_real(torch.stft(x, 16, 4, 16, window=window, return_complex=True))
    ours = hift.stft.stft(x)
    assert ours.shape == (2, 18, 120 * 7 + 1)
    torch.testing.assert_close(ours, torch.cat([ref[..., 0], ref[..., 1]], 1), atol=1e-5, rtol=0)
    mag, phase = torch.rand(2, 9, 841), torch.randn(2, 9, 841)
    ref = torch.istft(torch.polar(mag, phase), 16, 4, 16, window=window)
    torch.testing.assert_close(hift.stft.istft(mag * torch.cos(phase), mag * torch.sin(phase)), ref,
                               atol=1e-6, rtol=0)


def test_state_dict_names_are_the_checkpoints():
    state = vocoder_state_dict(HiFTGenerator(VocoderConfig.full()))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    expected = {
        "mel2wav.conv_pre.parametrizations.weight.original0": (512, 1, 1),     # weight norm's g
        "mel2wav.conv_pre.parametrizations.weight.original1": (512, 80, 7),    # and v
        "mel2wav.ups.0.parametrizations.weight.original1": (512, 256, 16),
        "mel2wav.ups.2.parametrizations.weight.original1": (128, 64, 7),
        "mel2wav.source_downs.0.weight": (256, 18, 30),                        # plain conv, stride 15
        "mel2wav.source_downs.2.weight": (64, 18, 1),
        "mel2wav.source_resblocks.2.convs1.2.parametrizations.weight.original1": (64, 64, 11),
        "mel2wav.resblocks.8.activations2.2.alpha": (64,),
        "mel2wav.conv_post.parametrizations.weight.original1": (18, 64, 7),
        "mel2wav.m_source.l_linear.weight": (1, 9),
        "mel2wav.f0_predictor.condnet.8.parametrizations.weight.original1": (512, 512, 3),
        "mel2wav.f0_predictor.classifier.weight": (1, 512),
    }
    assert {k: shapes.get(k) for k in expected} == expected
    assert sum(k.endswith("original0") for k in state) == 82, "weight-normed convolutions"
    assert all(k.startswith("mel2wav.") for k in state)
    print(f"\nfull HiFT: {sum(v.numel() for v in state.values()):,} parameters, {len(state)} tensors")


def test_checkpoint_round_trip_and_upstream_layouts(tmp_path):
    hift = small_vocoder()
    mel = stand_in_mel(30)
    ref = vocode(hift, mel, seed=1)
    for suffix in (".safetensors", ".pt"):
        loaded = load_vocoder(write_vocoder_checkpoint(hift, tmp_path / f"hift{suffix}"))
        np.testing.assert_array_equal(vocode(loaded, mel, seed=1), ref)
    # an S3Gen file holds flow.* and mel2wav.* side by side, without our metadata
    flow = random_flow(FlowConfig.small(), seed=0)
    both = {**{k: v.contiguous() for k, v in flow_state_dict(flow).items()},
            **{k: v.contiguous() for k, v in vocoder_state_dict(hift).items()}}
    save_tensors(both, tmp_path / "s3gen.safetensors", {})
    load_flow(tmp_path / "s3gen.safetensors", config=FlowConfig.small())
    np.testing.assert_array_equal(vocode(load_vocoder(tmp_path / "s3gen.safetensors", config=SMALL), mel, seed=1), ref)
    # the older weight-norm names (weight_g, weight_v) load as the parametrization's
    old = {k.replace("parametrizations.weight.original0", "weight_g").replace("parametrizations.weight.original1",
                                                                                "weight_v"): v.contiguous()
           for k, v in vocoder_state_dict(hift).items()}
    save_tensors(old, tmp_path / "old.safetensors", {})
    np.testing.assert_array_equal(vocode(load_vocoder(tmp_path / "old.safetensors", config=SMALL), mel, seed=1), ref)
    del old["mel2wav.conv_post.bias"]
    save_tensors(old, tmp_path / "broken.safetensors", {})
    with pytest.raises(CheckpointMismatch, match="mel2wav.conv_post.bias"):
        load_vocoder(tmp_path / "broken.safetensors", config=SMALL)
    with pytest.raises(CheckpointMismatch, match="shape mismatches"):
        load_vocoder(tmp_path / "s3gen.safetensors")  # small weights into the full-size model


def test_random_weights_exercise_every_parameter_kind():
    hift = small_vocoder()
    for name, module in hift.named_modules():
        if hasattr(module, "parametrizations"):
            g = module.parametrizations.weight.original0
            v = module.parametrizations.weight.original1
            norm = torch.linalg.vector_norm(v.flatten(1), dim=1).reshape(g.shape)
            assert (g - norm).abs().max() > 1e-3 * norm.max(), f"{name}: gain equals the direction's norm"
        if getattr(module, "bias", None) is not None:
            assert module.bias.abs().min() > 0, f"{name}: zero bias"
    alphas = torch.cat([p for n, p in hift.named_parameters() if n.endswith("alpha")])
    assert (alphas - 1).abs().min() > 0
    audio = vocode(hift, stand_in_mel(100), seed=0)
    f0 = hift.f0_predictor(torch.from_numpy(stand_in_mel(100))[None])
    assert 1e-2 < audio.std() < 0.5 and np.abs(audio).max() < 0.99, "neither silent nor clipped"
    assert (f0 < 10).any() and (f0 > 10).any(), "voiced and unvoiced frames"


def test_onnx_matches_torch(tmp_path):
    hift = small_vocoder()
    export_vocoder(hift, tmp_path)
    err = check_vocoder_onnx(hift, tmp_path)
    print(f"\nONNX Runtime vs torch (small): audio {err['audio']:.1e} (rms {err['audio_rms']:.1e}), f0 {err['f0']:.1e} Hz")
    assert err["audio"] < 1e-5 and err["f0"] < 1e-9
    # a whole utterance through both
    mel = stand_in_mel(60, seed=4)
    onnx = OnnxVocoder(tmp_path, threads=1)
    via_onnx = offline_vocode(onnx.f0, onnx.decode, mel, hift.source_params, seed=2)
    np.testing.assert_allclose(via_onnx, vocode(hift, mel, seed=2), atol=1e-5, rtol=0)


def test_float64_f0_is_the_predictor_and_does_not_depend_on_the_window():
    hift = small_vocoder()
    mel = stand_in_mel(120, seed=5)[None]
    with torch.no_grad():
        upstream_shaped = hift.f0_predictor(torch.from_numpy(mel)).numpy()     # float32, parametrized
    f0 = small_runner().f0(mel)
    assert f0.dtype == np.float64
    np.testing.assert_allclose(f0, upstream_shaped, atol=1e-3 * np.abs(f0).max(), rtol=0)
    window = small_runner().f0(mel[:, :, 30:90])[0]
    np.testing.assert_allclose(window[5:-5], f0[0, 35:85], atol=1e-9, rtol=0)   # float32: about 1e-4 Hz


@pytest.mark.fullsize
def test_onnx_matches_torch_full_size(tmp_path):
    hift = random_vocoder(VocoderConfig.full(), seed=0)
    export_vocoder(hift, tmp_path)
    err = check_vocoder_onnx(hift, tmp_path, frames=23)
    print(f"\nONNX Runtime vs torch (full): audio {err['audio']:.1e} (rms {err['audio_rms']:.1e}), f0 {err['f0']:.1e} Hz")
    assert err["audio"] < 1e-5 and err["f0"] < 1e-9


def test_offline_vocoding_fades_in_and_keeps_480_samples_per_frame():
    hift = small_vocoder()
    mel = stand_in_mel(50)
    audio = vocode(hift, mel, seed=0)
    assert audio.shape == (50 * HOP_SAMPLES,) and audio.dtype == np.float32
    assert not audio[:HOP_SAMPLES].any(), "the first 20 ms are silenced as upstream does"
    raw, _ = hift.inference(torch.from_numpy(mel)[None], seed=0)
    np.testing.assert_allclose(audio, raw[0].numpy() * np.pad(trim_fade(), (0, audio.size - 960), constant_values=1),
                               atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------
# The source and the stream (in process)


def test_excitation_is_a_function_of_seed_and_frame():
    p = small_vocoder().source_params
    e = Excitation(5, p)
    np.testing.assert_array_equal(e.noise(0, 120)[:, 37 * 480:90 * 480], Excitation(5, p).noise(37, 90))
    f0 = np.abs(150 + 80 * np.random.default_rng(0).standard_normal(90))
    whole, end = harmonic_source(f0, 0, np.zeros(p.rows), e)
    head, mid = harmonic_source(f0[:33], 0, np.zeros(p.rows), e)
    tail, end2 = harmonic_source(f0[33:], 33, mid, e)
    np.testing.assert_allclose(np.concatenate([head, tail], 1), whole, atol=1e-6, rtol=0)
    np.testing.assert_allclose(end2, end, atol=1e-9)
    assert np.abs(Excitation(6, p).noise(0, 10) - e.noise(0, 10)).mean() > 0.5


FRAMES = 110
SCHEDULES = {
    "one chunk": [FRAMES],
    "uneven": [14, 10, 20, 3, 1, 40, 22],
    "empty chunks and an empty END": [30, 0, 25, 0, 55, 0],
    "one frame at a time": [1] * 30 + [80],
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_streamed_equals_offline_in_process(name):
    hift = small_vocoder()
    runner = small_runner()
    mel = stand_in_mel(FRAMES, seed=1)
    ref = torch_vocode(mel, seed=9)
    audio, offsets, vs = stream_in_process(runner, hift, mel, SCHEDULES[name], seed=9)
    assert audio.shape == (HOP_SAMPLES * mel.shape[1],), "exactly 480 samples per mel frame"
    err = np.abs(audio - ref).max()
    report = seam_report(audio, ref, offsets)
    print(f"\n{name}: max |streamed - offline| {err:.1e} (signal std {ref.std():.3f}); {report}; "
          f"{vs.network_calls} network calls")
    assert err < STREAM_TOL
    assert report["seam_excess"] < STREAM_TOL
    assert report["seam_jump"] <= report["jump_elsewhere"]


def _repository_runners(tmp_path, hift):
    """The served vocoder's two runners, each opened from a version folder the repository writer made
    (``vocoder_backend`` onnx and torch, cpu target, so the torch one runs on the CPU)."""
    from s3flow.repository.generator import write_vocoder_models
    from s3flow.repository.settings import RepositorySettings
    from s3flow.runtime.vocoder_runner import VocoderRunnerSettings, open_vocoder_runner

    runners = {}
    for backend in ("onnx", "torch"):
        out = tmp_path / backend
        write_vocoder_models(out, hift, 80, RepositorySettings(vocoder_backend=backend))
        params = {"vocoder_backend": backend, "intra_op_threads": "1"}
        runners[backend] = open_vocoder_runner(out / "vocoder" / "1", VocoderRunnerSettings.from_args(params))
    return runners


def test_torch_backend_streams_like_the_onnx_backend_and_like_offline(tmp_path):
    """The gpu target's runner (torch, here on the CPU) behind the same VocoderStream as ONNX Runtime: the
    same audio, streamed or not, and streamed equal to its own offline vocoding."""
    hift = small_vocoder()
    runners = _repository_runners(tmp_path, hift)
    assert isinstance(runners["onnx"], OnnxVocoder) and isinstance(runners["torch"], TorchVocoder)
    assert runners["torch"].device.type == "cpu"
    mel = stand_in_mel(FRAMES, seed=6)
    sizes = SCHEDULES["uneven"]
    audio = {b: stream_in_process(r, hift, mel, sizes, seed=4)[0] for b, r in runners.items()}
    offline = {b: offline_vocode(r.f0, r.decode, mel, hift.source_params, seed=4) for b, r in runners.items()}
    f0 = {b: r.f0(mel[None]) for b, r in runners.items()}
    figures = {"torch streamed vs torch offline": np.abs(audio["torch"] - offline["torch"]).max(),
               "torch streamed vs onnx streamed": np.abs(audio["torch"] - audio["onnx"]).max(),
               "torch offline vs onnx offline": np.abs(offline["torch"] - offline["onnx"]).max(),
               "torch offline vs vocode()": np.abs(offline["torch"] - torch_vocode(mel, seed=4)).max(),
               "f0 Hz torch vs onnx": np.abs(f0["torch"] - f0["onnx"]).max()}
    print("\n" + "; ".join(f"{k} {v:.1e}" for k, v in figures.items()) + f" (signal std {offline['onnx'].std():.3f})")
    assert audio["torch"].shape == audio["onnx"].shape == (HOP_SAMPLES * FRAMES,)
    assert figures["torch streamed vs torch offline"] < STREAM_TOL
    assert figures["torch offline vs vocode()"] == 0, "the served torch runner is the offline vocoder's code"
    assert figures["torch streamed vs onnx streamed"] < 1e-5 and figures["torch offline vs onnx offline"] < 1e-5
    assert figures["f0 Hz torch vs onnx"] < 1e-9
    assert offline["onnx"].std() > 1e-2, "a comparison of silence would prove nothing"


def test_vocoder_runner_settings():
    from s3flow.runtime.vocoder_runner import VocoderRunnerSettings, open_vocoder_runner, vocoder_backend_for

    s = VocoderRunnerSettings.from_args({"vocoder_backend": "torch", "intra_op_threads": "2"}, "GPU", "1")
    assert (s.backend, s.device, s.threads) == ("torch", "cuda:1", 2)
    assert VocoderRunnerSettings.from_args({}, "CPU") == VocoderRunnerSettings("onnx", "cpu", 0)
    assert VocoderRunnerSettings.from_args({"allow_spinning": "false"}, "CPU").spinning is False
    with pytest.raises(ValueError, match="allow_spinning must be true or false, got 'maybe'"):
        VocoderRunnerSettings.from_args({"allow_spinning": "maybe"})
    assert VocoderRunnerSettings.from_args({"vocoder_backend": "TORCH"}, "MODEL").device == "cpu"
    with pytest.raises(ValueError, match="vocoder_backend must be one of .* got 'tensorrt'"):
        VocoderRunnerSettings.from_args({"vocoder_backend": "tensorrt"})
    with pytest.raises(ValueError, match="ONNX Runtime on the CPU"):
        VocoderRunnerSettings.from_args({"vocoder_backend": "onnx"}, "GPU")
    with pytest.raises(ValueError, match="intra_op_threads must be an integer, got 'x'"):
        VocoderRunnerSettings.from_args({"intra_op_threads": "x"})
    assert [vocoder_backend_for(t) for t in ("cpu", "gpu")] == ["onnx", "torch"]
    assert vocoder_backend_for("gpu", "onnx") == "onnx"
    with pytest.raises(ValueError, match="got 'cuda'"):
        vocoder_backend_for("gpu", "cuda")
    with pytest.raises(FileNotFoundError, match="hift.safetensors"):
        open_vocoder_runner("/nonexistent", VocoderRunnerSettings("torch", "cpu"))
    if not torch.cuda.is_available():  # CI: the GPU path refuses clearly instead of failing on first use
        with pytest.raises((RuntimeError, FileNotFoundError)):
            open_vocoder_runner("/nonexistent", VocoderRunnerSettings("torch", "cuda:0"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py covers it on GPU hosts)")
def test_torch_runner_on_cuda_matches_the_cpu():
    hift = small_vocoder()
    cpu, gpu = small_runner(), TorchVocoder(hift, "cuda")
    mel = stand_in_mel(FRAMES, seed=2)
    ref = offline_vocode(cpu.f0, cpu.decode, mel, hift.source_params, seed=1)
    np.testing.assert_allclose(offline_vocode(gpu.f0, gpu.decode, mel, hift.source_params, seed=1), ref, atol=1e-5, rtol=0)
    audio = stream_in_process(gpu, hift, mel, SCHEDULES["uneven"], seed=1)[0]
    np.testing.assert_allclose(audio, offline_vocode(gpu.f0, gpu.decode, mel, hift.source_params, seed=1),
                               atol=1e-5, rtol=0)


def test_seams_of_stateless_chunks_are_caught():
    """The seam check can fail: vocoding each chunk alone (no context, no carried phase) breaks it."""
    hift = small_vocoder()
    runner = small_runner()
    mel = stand_in_mel(FRAMES, seed=1)
    ref = torch_vocode(mel, seed=9)
    sizes, parts, at = SCHEDULES["uneven"], [], 0
    for n in sizes:
        parts.append(offline_vocode(runner.f0, runner.decode, mel[:, at:at + n], hift.source_params, seed=9,
                                    fade=at == 0))
        at += n
    naive = np.concatenate(parts)
    report = seam_report(naive, ref, np.cumsum(sizes)[:-1] * HOP_SAMPLES)
    print(f"\nstateless chunks: {report}")
    assert report["seam_excess"] > 100 * STREAM_TOL and report["seam_error"] > 0.1 * ref.std()


def test_a_short_lookahead_is_cross_faded():
    """With lookahead below the receptive field the stream is no longer exact; the cross-fade smooths
    what is left at the seams (figures printed: the latency / accuracy trade of lookahead_frames)."""
    hift = small_vocoder()
    runner = small_runner()
    mel = stand_in_mel(FRAMES, seed=1)
    ref = torch_vocode(mel, seed=9)
    sizes = SCHEDULES["uneven"]
    reports = {}
    for lookahead in (4, 12, 20):
        for fade in (0, 480):
            audio, offsets, _ = stream_in_process(runner, hift, mel, sizes, seed=9, lookahead_frames=lookahead,
                                                  crossfade_samples=fade)
            reports[lookahead, fade] = dict(seam_report(audio, ref, offsets), error=float(np.abs(audio - ref).max()))
    print("\nlookahead, cross-fade: max error, seam excess")
    for (lookahead, fade), r in reports.items():
        print(f"  {lookahead:2d} frames, {fade:3d} samples: {r['error']:.1e}, {r['seam_excess']:.1e}")
    assert reports[4, 480]["seam_excess"] < reports[4, 0]["seam_excess"]
    assert reports[20, 480]["error"] < STREAM_TOL and reports[20, 0]["error"] < STREAM_TOL


def test_default_context_and_lookahead_cover_the_receptive_field():
    """Measured by perturbation (the small config has the full one's strides, kernels and dilations)."""
    runner = small_runner()
    mel = stand_in_mel(80, seed=2)[None]
    harmonics = (0.1 * np.random.default_rng(0).standard_normal((1, 9, 80 * HOP_SAMPLES))).astype(np.float32)
    base = runner.decode(mel, harmonics)[0]

    def reach(changed):  # frames before and after frame 40 whose samples changed
        idx = np.nonzero(runner.decode(*changed)[0] != base)[0]
        return 40 - idx.min() / HOP_SAMPLES, (idx.max() + 1) / HOP_SAMPLES - 41

    bumped_mel, bumped_source = mel.copy(), harmonics.copy()
    bumped_mel[..., 40] += 1.0
    bumped_source[..., 40 * HOP_SAMPLES] += 1.0
    mel_left, mel_right = reach((bumped_mel, harmonics))
    src_left, src_right = reach((mel, bumped_source))
    s = StreamSettings()
    print(f"\nreceptive field in frames: mel -{mel_left:.1f} +{mel_right:.1f}, source -{src_left:.1f} "
          f"+{src_right + 1:.1f}; F0 +{F0_LOOKAHEAD_FRAMES}; defaults look-behind {s.lookbehind_frames}, "
          f"lookahead {s.lookahead_frames}")
    assert s.lookbehind_frames >= max(mel_left, src_left)
    assert s.lookahead_frames >= max(mel_right, src_right + 1 + F0_LOOKAHEAD_FRAMES)


def test_stream_rejects_broken_input():
    hift = small_vocoder()
    runner = small_runner()
    vs = VocoderStream(runner.f0, runner.decode, hift.source_params, StreamSettings(max_utterance_frames=50))
    state = vs.start(0)
    state, _ = vs.push(state, stand_in_mel(10), 0, end=False)
    with pytest.raises(StreamError, match="frame offset 12 does not continue the 10 frames"):
        vs.push(state, stand_in_mel(5), 12, end=False)
    with pytest.raises(StreamError, match=r"mel must have shape \(n_feats=80, frames\), got \[79, 5\]"):
        vs.push(state, stand_in_mel(5)[:79], 10, end=False)
    bad = stand_in_mel(5)
    bad[3, 2] = np.nan
    with pytest.raises(StreamError, match="1 NaN or Inf"):
        vs.push(state, bad, 10, end=False)
    with pytest.raises(StreamError, match="above max_utterance_frames 50"):
        vs.push(state, stand_in_mel(41), 10, end=False)
    with pytest.raises(ValueError, match="lookbehind_frames must be >= 5"):
        StreamSettings(lookbehind_frames=F0_LOOKAHEAD_FRAMES - 1).check()
    with pytest.raises(ValueError, match=r"idle_timeout_s must be > 0, got 0.0$"):
        SequenceLimits(idle_timeout_s=0.0).check()           # what the vocoder holds: a config parameter too
    with pytest.raises(ValueError, match=r"lookahead_frames must be >= 0, got -1$"):
        StreamSettings(lookahead_frames=-1).check()


def test_idle_states_are_evicted():
    """The vocoder model's table: a START's state is begun, then committed once its chunk is answered; idle
    time counts from then, and a state whose chunk is still being vocoded is never evicted."""
    now = [0.0]
    table = SequenceTable(SequenceLimits(idle_timeout_s=5.0, max_live_sequences=2), clock=lambda: now[0])
    hift = small_vocoder()
    vs = VocoderStream(None, None, hift.source_params, StreamSettings())
    table.begin(1, vs.start(0))
    table.commit(1, end=False)
    now[0] = 3.0
    table.begin(2, vs.start(0))
    table.commit(2, end=False)
    now[0] = 6.0
    assert table.evict_idle() == [1] and 2 in table
    table.begin(3, vs.start(0))                      # in flight: not committed yet
    now[0] = 20.0
    assert table.evict_idle() == [2] and 3 in table
    table.commit(3, end=False)
    now[0] = 25.5
    assert table.evict_idle() == [3] and len(table) == 0


# ---------------------------------------------------------------------------------------------------
# Served: token2wav on a real tritonserver

SOLVER = SolverSettings.of(max_steps=20, max_utterance_frames=600, max_request_bytes=200_000, max_live_sequences=32)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from s3flow.model.random_checkpoint import write_random_checkpoint
    from s3flow.repository.generator import write_repository
    from s3flow.repository.settings import Batching, RepositorySettings
    from s3flow.server.triton_server import TritonServer

    root = tmp_path_factory.mktemp("served_wav")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=7))
    hift = load_vocoder(write_vocoder_checkpoint(small_vocoder(), root / "hift.safetensors"))
    settings = RepositorySettings(solver=SOLVER, batching=Batching(max_queue_delay_us=20_000), ort_threads=1)
    # exact streaming from the first response (the served default's first lookahead is its own test)
    write_repository(root / "repo", flow, settings, vocoder=hift, vocoder_settings=StreamSettings())
    onnx = OnnxVocoder(root / "repo" / "vocoder" / "1", threads=1)  # the served graphs, as served
    (root / "snapshot.key").write_text("served-wav-test-snapshot-key")  # every answer but END carries a snapshot
    with TritonServer(root / "repo", log_file=root / "server.log",
                      env={"S3FLOW_SNAPSHOT_KEY_FILE": str(root / "snapshot.key")}, background_stop=True) as server:
        yield server, flow, hift, onnx


def onnx_vocode(onnx, hift, mel, seed):
    return offline_vocode(onnx.f0, onnx.decode, mel, hift.source_params, seed=seed)


@pytest.mark.server
def test_served_one_chunk_equals_offline(served):
    from helpers import offline
    from s3flow_client import StreamingClient
    from s3flow_client.demo import demo_utterance

    server, flow, hift, onnx = served
    u = demo_utterance(1.0, seed=12, noise_seed=4)
    u.chunks = [len(u.speech_tokens)]
    [got] = StreamingClient(server.grpc_url, "token2wav").synthesize([u])
    mel = offline(flow, u)
    np.testing.assert_allclose(got.mel, mel, atol=5e-4, rtol=0)
    assert got.audio.shape == (HOP_SAMPLES * mel.shape[1],)
    np.testing.assert_allclose(got.audio, onnx_vocode(onnx, hift, got.mel, u.seed), atol=SERVED_TOL, rtol=0)
    err = np.abs(got.audio - onnx_vocode(onnx, hift, mel, u.seed)).max()
    print(f"\none chunk: served audio vs offline vocoding of the offline mel: {err:.1e} (std {got.audio.std():.3f})")
    assert err < 2e-3  # the served mel is within 5e-4 of the offline mel (measured 4e-4)


@pytest.mark.server
def test_served_stream_equals_offline_vocoding_and_has_no_seams(served):
    from helpers import offline
    from s3flow_client import StreamingClient, chunk_schedule
    from s3flow_client.demo import demo_utterance

    server, flow, hift, onnx = served
    u = demo_utterance(2.4, seed=11, noise_seed=3)
    u.chunks = chunk_schedule(len(u.speech_tokens), 8, 2.0, 40)
    [got] = StreamingClient(server.grpc_url, "token2wav").synthesize([u])
    frames = 2 * len(u.speech_tokens)
    assert got.mel.shape == (80, frames) and got.audio.shape == (HOP_SAMPLES * frames,)
    assert len(got.chunk_samples) == len(u.chunks) and got.chunk_samples[-1] > 0
    ref = onnx_vocode(onnx, hift, got.mel, u.seed)
    seams = np.cumsum(got.chunk_samples)[:-1]
    report = seam_report(got.audio, ref, seams)
    err = np.abs(got.audio - ref).max()
    vs_offline_mel = np.abs(got.audio - onnx_vocode(onnx, hift, offline(flow, u), u.seed)).max()
    print(f"\nserved stream ({u.chunks} tokens -> samples {got.chunk_samples}): vs offline vocoding of the "
          f"served mel {err:.1e}; {report}; vs offline vocoding of the offline mel {vs_offline_mel:.2f} (the "
          f"streamed mel itself differs from offline); first audio {got.first_audio_s * 1000:.0f} ms")
    assert err < SERVED_TOL
    assert report["seam_excess"] < SERVED_TOL and report["seam_jump"] <= report["jump_elsewhere"]


@pytest.mark.server
def test_the_vocoder_calibrates_with_the_snapshots_a_served_push_seals(served):
    """This server gives snapshots (a key): the calibration seals each push as a served one does, and prices the
    vocoder before any token2wav stream (a stand-in bound to no real solver section failed it: every token2wav START
    then waited its whole bound for a price)."""
    from s3flow.serving.load import LoadBoard

    server = served[0]
    board, t0 = LoadBoard(LoadBoard.default_folder(server.pid)), time.monotonic()
    while not board.read().vocoder_capacity and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    log = server.log_file.read_text()
    assert "vocoder: calibration:" in log and "calibration failed" not in log and "Traceback" not in log, \
        server.log_tail()
    assert board.read().vocoder_capacity > 0


@pytest.mark.server
def test_served_streams_at_once_keep_their_own_state(served):
    from s3flow_client import StreamingClient, chunk_schedule
    from s3flow_client.demo import demo_utterance

    server, _, hift, onnx = served
    utts = []
    for i in range(3):
        u = demo_utterance(1.0 + 0.4 * i, seed=50 + i, noise_seed=i)
        u.chunks = chunk_schedule(len(u.speech_tokens), 6, 2.0, 24)
        utts.append(u)
    for u, got in zip(utts, StreamingClient(server.grpc_url, "token2wav").synthesize(utts)):
        assert got.audio.size == HOP_SAMPLES * got.mel.shape[1]
        np.testing.assert_allclose(got.audio, onnx_vocode(onnx, hift, got.mel, u.seed), atol=SERVED_TOL, rtol=0)


@pytest.mark.server
def test_the_server_counts_each_utterances_first_audio_once_within_the_clients_figure(served):
    """s3flow_first_audio_seconds: one observation per token2wav utterance, START arrival to first sound, at
    most what the client measured (its figure adds the network and the response's way back)."""
    from s3flow.server.metrics_reader import histogram, read_metrics
    from s3flow_client import StreamingClient
    from s3flow_client.demo import demo_utterance

    server = served[0]
    url = f"127.0.0.1:{server.metrics_port}"
    before = histogram(read_metrics(url), "s3flow_first_audio_seconds")
    utts = [demo_utterance(1.2, seed=70 + i, noise_seed=i) for i in range(2)]
    results = StreamingClient(server.grpc_url, "token2wav").synthesize(utts)
    after = histogram(read_metrics(url), "s3flow_first_audio_seconds")
    assert after.count - before.count == 2
    assert 0 < after.sum - before.sum <= sum(r.first_audio_s for r in results)


@pytest.mark.server
def test_served_torch_backend_streams_what_the_onnx_backend_streams(served, tmp_path):
    """token2wav with ``vocoder_backend torch`` (the gpu target's runner; here KIND_CPU, device cpu) on its
    own server, against the ONNX-backed server of the module: same flow, same vocoder weights, same stream."""
    from s3flow.runtime.vocoder_runner import VocoderRunnerSettings, open_vocoder_runner
    from s3flow.serving.config_params import Params
    from s3flow.repository.model_config import read_config
    from s3flow.repository.generator import write_repository
    from s3flow.repository.settings import Batching, RepositorySettings
    from s3flow.server.triton_server import TritonServer
    from s3flow_client import StreamingClient, chunk_schedule
    from s3flow_client.demo import demo_utterance

    onnx_server, flow, hift, onnx = served
    settings = RepositorySettings(solver=SOLVER, batching=Batching(max_queue_delay_us=20_000), ort_threads=1,
                                  vocoder_backend="torch")
    write_repository(tmp_path / "repo", flow, settings, vocoder=hift, vocoder_settings=StreamSettings())  # as served
    config = read_config(tmp_path / "repo" / "vocoder")
    assert Params(config).str("vocoder_backend") == "torch"
    assert [g.kind for g in config.instance_group] == [config.instance_group[0].KIND_CPU]
    assert not list((tmp_path / "repo" / "vocoder" / "1").glob("*.onnx"))
    local = open_vocoder_runner(tmp_path / "repo" / "vocoder" / "1",
                                VocoderRunnerSettings.from_args({"vocoder_backend": "torch"}))
    u = demo_utterance(2.0, seed=21, noise_seed=6)
    u.chunks = chunk_schedule(len(u.speech_tokens), 8, 2.0, 40)
    with TritonServer(tmp_path / "repo", log_file=tmp_path / "server.log") as server:
        [got] = StreamingClient(server.grpc_url, "token2wav").synthesize([u])
    [ref] = StreamingClient(onnx_server.grpc_url, "token2wav").synthesize([u])
    assert "HiFT in torch on cpu" in (tmp_path / "server.log").read_text()
    frames = 2 * len(u.speech_tokens)
    assert got.audio.shape == ref.audio.shape == (HOP_SAMPLES * frames,)
    mel_diff = np.abs(got.mel - ref.mel).max()
    vs_onnx = np.abs(got.audio - ref.audio).max()
    vs_offline = np.abs(got.audio - offline_vocode(local.f0, local.decode, got.mel, hift.source_params, u.seed)).max()
    print(f"\nserved token2wav, torch vocoder vs ONNX vocoder ({u.chunks} tokens): audio {vs_onnx:.1e} "
          f"(mel {mel_diff:.1e}, std {ref.audio.std():.3f}); vs offline torch vocoding of its mel {vs_offline:.1e}")
    assert mel_diff < 1e-5, "both servers run the same flow"
    assert vs_onnx < 1e-5 and vs_offline < SERVED_TOL
    # the vocoder kept what it measured for the next server here (issue 48: a restarted server priced its first
    # token2wav burst by the solver alone), and the next one is priced by it before its first request
    import json
    from s3flow.serving.load import LoadBoard
    [price] = (tmp_path / "repo" / "vocoder" / "price").glob("*.json")
    fixed, per_unit, _ = json.loads(price.read_text())["state"]["estimator"]
    assert fixed > 0 or per_unit > 0, "timed pushes"
    with TritonServer(tmp_path / "repo", log_file=tmp_path / "again.log") as again:
        [report] = [r for r in LoadBoard(LoadBoard.default_folder(again.pid)).read().reports if r.kind == "vocoder"]
        assert report.costs.known, "the vocoder's price before its first push"


def vocoder_request(server, seq_id, start, end, mel, offset):
    inputs = []
    for name, value in (("mel", mel), ("frame_offset", np.array([[offset]], np.int64))):
        t = grpcclient.InferInput(name, list(value.shape), "FP32" if value.dtype == np.float32 else "INT64")
        t.set_data_from_numpy(value)
        inputs.append(t)
    return server.client().infer("vocoder", inputs, sequence_id=seq_id, sequence_start=start, sequence_end=end)


@pytest.mark.server
def test_vocoder_model_rejects_a_frame_gap_and_the_stream_goes_on(served):
    """A chunk leaving a gap is refused (``fail``) and changes nothing: the right chunk after it continues the
    stream exactly (s3flow.serving.vocoder_session); after its END the stream is gone."""
    server, _, hift, onnx = served
    mel = stand_in_mel(40, seed=3)[None]
    out = vocoder_request(server, 555_001, True, False, mel[:, :, :30], 0)
    assert out.as_numpy("audio").shape == (1, (30 - 20) * HOP_SAMPLES), "20 frames of lookahead held back"
    with pytest.raises(InferenceServerException, match="frame offset 31 does not continue the 30 frames"):
        vocoder_request(server, 555_001, False, False, mel[:, :, 30:], 31)
    rest = vocoder_request(server, 555_001, False, True, mel[:, :, 30:], 30).as_numpy("audio")
    np.testing.assert_allclose(np.concatenate([out.as_numpy("audio")[0], rest[0]]), onnx_vocode(onnx, hift, mel[0], 0),
                               atol=SERVED_TOL, rtol=0)
    with pytest.raises(InferenceServerException, match="must specify the START flag"):   # ended: Triton says so
        vocoder_request(server, 555_001, False, True, mel[:, :, 30:], 40)
    # a sequence streamed straight to the vocoder equals offline vocoding (seed 0 when none is sent)
    first = vocoder_request(server, 555_002, True, False, mel[:, :, :25], 0).as_numpy("audio")
    rest = vocoder_request(server, 555_002, False, True, mel[:, :, 25:], 25).as_numpy("audio")
    np.testing.assert_allclose(np.concatenate([first[0], rest[0]]), onnx_vocode(onnx, hift, mel[0], 0),
                               atol=SERVED_TOL, rtol=0)


@pytest.mark.server
def test_cli_writes_wav_and_png_while_streaming(served, tmp_path):
    from s3flow_client.__main__ import main
    from s3flow_client.audio import read_wav

    server, _, hift, onnx = served
    code = main(["--url", server.grpc_url, "--model", "token2wav", "--seconds", "1.2", "--first-chunk", "8",
                 "--seed", "5", "--out-dir", str(tmp_path), "--no-progress"])
    assert code == 0
    audio, rate = read_wav(tmp_path / "audio_0.wav")
    mel = np.load(tmp_path / "mel_0.npy")
    assert rate == 24000 and audio.size == HOP_SAMPLES * mel.shape[1]
    np.testing.assert_allclose(audio, onnx_vocode(onnx, hift, mel, 5), atol=1.5 / 32767, rtol=0)
    assert (tmp_path / "audio_0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_small_first_lookahead_sounds_at_once_and_is_exact_after_the_first_response():
    """first_lookahead_frames: the first push of 14 frames (the client's first 10-token chunk) carries audio
    at once; from the second response on (after its cross-fade) the stream equals offline vocoding again."""
    hift, runner = small_vocoder(), small_runner()
    mel = stand_in_mel(120, seed=2)
    ref = torch_vocode(mel, seed=5)
    sizes = [14, 20, 40, 46]
    exact, offsets_exact, _ = stream_in_process(runner, hift, mel, sizes, seed=5)
    assert offsets_exact[1] == 0, "with the regular lookahead (20) the first response carries nothing"
    from s3flow.engine.vocoder_stream import SERVED_FIRST_LOOKAHEAD_FRAMES as served   # token2wav's default
    early, offsets, _ = stream_in_process(runner, hift, mel, sizes, seed=5, first_lookahead_frames=served)
    first = offsets[1]                           # samples the first response carried: 14 - 4 frames
    assert served == 4 and first == (14 - served) * HOP_SAMPLES
    settle = first + StreamSettings().crossfade_samples
    assert np.abs(early[settle:] - ref[settle:]).max() < STREAM_TOL
    assert np.abs(exact - ref).max() < STREAM_TOL and early.shape == ref.shape


def stream_naming(server, model: str, seq_id: int, u, outputs) -> list[dict]:
    """Stream ``u`` chunk by chunk to ``model`` over one gRPC stream with plain tritonclient, naming ``outputs``
    (None: naming none, so that every output comes); every response's tensors, as a dict per chunk."""
    import queue

    from s3flow_client.wire import infer_inputs

    events = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    answers, lo = [], 0
    try:
        for k, n in enumerate(u.chunks):
            start, end = k == 0, k == len(u.chunks) - 1
            named = None if outputs is None else [grpcclient.InferRequestedOutput(o) for o in outputs]
            client.async_stream_infer(model, infer_inputs(u.request(lo, lo + n, start)), sequence_id=seq_id,
                                      sequence_start=start, sequence_end=end, outputs=named)
            lo += n
            result, error = events.get(timeout=60)
            assert error is None, f"{model} naming {outputs}, chunk {k}: {error}"
            answers.append({t.name: result.as_numpy(t.name) for t in result.get_response().outputs})
    finally:
        client.stop_stream()
        client.close()
    return answers


@pytest.mark.server
def test_a_request_naming_any_subset_of_the_outputs_gets_exactly_those_on_every_chunk(served):
    """Every non-empty subset of token2mel's and token2wav's outputs, named on every request of a 3-chunk
    utterance (START, a middle chunk, END): each response carries exactly the named outputs, equal to those of
    the same utterance streamed naming none (issue 31: with the solver's mel both an output of token2wav and the
    vocoder's input, naming only 'audio' deadlocked the ensemble). The snapshot is among them (issue 35): the
    same bytes for the same utterance, the vocoder's section after the solver's in token2wav."""
    import itertools

    from s3flow_client.demo import demo_utterance
    from s3flow_contract.tensors import STREAM_RESPONSE, VOCODER_OUTPUTS, names

    server = served[0]
    u = demo_utterance(0.8, seed=31, noise_seed=1)
    u.chunks = [8, 6, len(u.speech_tokens) - 14]
    u.n_timesteps = 2   # (78 streams one after another: what is named is the point, not the solve)
    seq = iter(range(3100, 3200))
    tried = 0
    snapshots = {}
    for model, outs in (("token2mel", names(STREAM_RESPONSE)), ("token2wav", names(VOCODER_OUTPUTS))):
        everything = stream_naming(server, model, next(seq), u, None)
        assert all(set(a) == set(outs) for a in everything)
        snapshots[model] = [a["snapshot"].reshape(-1)[0] for a in everything]
        for size in range(1, len(outs) + 1):
            for subset in itertools.combinations(outs, size):
                got = stream_naming(server, model, next(seq), u, subset)
                for k, (answer, full) in enumerate(zip(got, everything)):
                    assert set(answer) == set(subset), f"{model} naming {subset}, chunk {k}: got {sorted(answer)}"
                    for name in subset:
                        np.testing.assert_array_equal(answer[name], full[name], err_msg=f"{model} {subset} {name}")
                tried += 1
    assert tried == 15 + 63                     # token2mel's 4 outputs, token2wav's 6
    for mel_snapshot, wav_snapshot in zip(snapshots["token2mel"][:-1], snapshots["token2wav"][:-1]):
        assert mel_snapshot and wav_snapshot.startswith(mel_snapshot) and len(wav_snapshot) > len(mel_snapshot)
    assert snapshots["token2mel"][-1] == snapshots["token2wav"][-1] == b"", "none after END"


@pytest.mark.server
@pytest.mark.parametrize("mid_solve", [False, True], ids=["between-chunks", "mid-solve"])
def test_a_killed_token2wav_client_frees_the_solver_and_the_vocoder(served, mid_solve):
    """Issue 31's invariant for the vocoder: its state of a stream whose client was SIGKILLed goes too (a reaper
    thread, no request needed), after the solver's (a stream the solver still holds is never idle there).
    ``mid-solve``: killed while the solver works on its third chunk, whose answer then goes into a cancelled
    ensemble request and never reaches the vocoder (``s3flow.serving.arrivals.Delivery``: held 60 s before)."""
    import time

    from s3flow.server.metrics_reader import metric_sum, read_metrics
    from s3flow_tools.bench.killed_client import kill_mid_stream

    server = served[0]
    how = dict(chunk=20, steps=10, after_s=0.03) if mid_solve else {}
    killed = kill_mid_stream(server.grpc_url, "token2wav", seed=90, seconds=2.8, **how)

    def live():
        m = read_metrics(f"127.0.0.1:{server.metrics_port}")
        return metric_sum(m, "s3flow_live_sequences"), metric_sum(m, "s3flow_vocoder_live_sequences")

    assert live()[1] == 1, "the vocoder holds the stream"
    idle = SOLVER.sequences.idle_timeout_s
    while live() != (0, 0):
        assert time.monotonic() - killed < 2 * idle + 4, f"live (solver, vocoder) {live()}"
        time.sleep(0.2)
    print(f"\nsolver and vocoder freed {time.monotonic() - killed:.1f} s after the kill (idle timeout {idle} s)")
