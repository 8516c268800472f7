"""The analytic FLOP count against torch's FlopCounterMode, the per-chunk call shapes against what the
engine really calls, and the ONNX Runtime adapters against torch (small configs; seconds)."""
import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import make_engine, small_flow, stream_in_process, torch_encoder
from s3flow.model.encoder import random_encoder_inputs
from s3flow.runtime.onnx_export import export_encoder
from s3flow.model.estimator import ConditionalDecoder, EstimatorConfig
from s3flow.model.flops import chunk_calls, estimator_flops, solve_flops
from s3flow.model.solver import EstimatorInputs
from s3flow.runtime.onnx_export import export_estimator, make_estimator_inputs
from s3flow.runtime.ort import OrtSettings
from s3flow.runtime.ort_engine import OrtEncoder, OrtEstimator
from s3flow.engine.settings import ChunkSolving
from s3flow.engine.streaming import StreamingEngine
from s3flow_client.demo import demo_utterance

CONFIGS = {
    "small": EstimatorConfig.small(),
    "small-meanflow": EstimatorConfig.small(meanflow=True),
    # two levels: strided down- and transposed up-sampling, odd lengths round up
    "two-level": EstimatorConfig(channels=(32, 48), attention_head_dim=16, n_blocks=2, num_mid_blocks=1,
                                 num_heads=2),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("batch,frames", [(1, 7), (3, 31), (2, 64)])
def test_analytic_count_equals_flop_counter_mode(name, batch, frames):
    cfg = CONFIGS[name]
    model = ConditionalDecoder(cfg).eval()
    inputs = make_estimator_inputs(model, batch, frames)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    assert estimator_flops(cfg, batch, frames).total == counter.get_total_flops()


def test_full_size_count_and_its_parts():
    f = estimator_flops(EstimatorConfig.full(), 2, 300)
    assert f.total == 99_960_946_688   # FlopCounterMode on the full module gives the same (checked once)
    # per-row time MLPs (320 -> 1024 -> 1024, then 1024 -> 256 in each of the 14 resnets) do not grow with T
    per_row = 2 * 2 * (320 * 1024 + 1024 * 1024) + 2 * 2 * 1024 * 256 * 14
    # by hand: 56 transformer blocks x 2 * 300 frames x (q, k, v, out: 4 * 256 * 512 + ff: 2 * 256 * 1024) MACs
    assert f.linear - per_row == 2 * 56 * 600 * (4 * 256 * 512 + 2 * 256 * 1024)
    # attention grows with T^2, convolutions and frame-wise linears with T
    f2 = estimator_flops(EstimatorConfig.full(), 2, 600)
    assert f2.attention == 4 * f.attention
    assert f2.linear - per_row == 2 * (f.linear - per_row) and f2.conv == 2 * f.conv


@pytest.mark.parametrize("meanflow", [False, True])
def test_chunk_calls_are_the_shapes_the_engine_runs(meanflow):
    flow = small_flow(meanflow)
    seen = []

    def recording(inputs):
        seen.append((inputs.x.shape[0], inputs.x.shape[2]))
        with torch.inference_mode():
            return flow.estimator(**inputs.named())

    engine = StreamingEngine(torch_encoder(flow), recording, n_feats=80, meanflow=meanflow,
                             solving=ChunkSolving(context_frames=-1))  # chunk_calls models the prefix re-run
    u = demo_utterance(1.2, seed=4)
    sizes = [7, 11, 12]
    u.n_timesteps = 3
    stream_in_process(engine, [u], [sizes])
    want = chunk_calls(flow.config.estimator, len(u.prompt_tokens), sizes, 3, guided=True)
    assert seen == want
    assert solve_flops(flow.config.estimator, seen) == sum(estimator_flops(flow.config.estimator, b, t).total
                                                           for b, t in want)


@pytest.fixture(scope="module")
def onnx_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ort")
    out = {}
    for meanflow in (False, True):
        flow = small_flow(meanflow)
        out[meanflow] = (flow, export_estimator(flow.estimator, root / f"est{meanflow}.onnx"),
                         export_encoder(flow.encoder, root / f"enc{meanflow}.onnx"))
    return out


@pytest.mark.parametrize("meanflow", [False, True])
@pytest.mark.parametrize("io_binding", [True, False])
def test_ort_estimator_and_encoder_equal_torch(onnx_files, meanflow, io_binding):
    flow, est_path, enc_path = onnx_files[meanflow]
    est = OrtEstimator(est_path, OrtSettings(threads=1), io_binding=io_binding)
    assert est.meanflow == meanflow
    for batch, frames in [(3, 57), (2, 20)]:   # the output buffer is re-made when the shape changes
        inputs = make_estimator_inputs(flow.estimator, batch, frames, seed=frames)
        with torch.no_grad():
            ref = flow.estimator(**inputs)
        got = est(EstimatorInputs(**inputs))
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=5e-5, rtol=0)
    with pytest.raises(ValueError, match="meanflow"):
        est(EstimatorInputs(**{**inputs, "r": None if meanflow else inputs["t"]}))
    enc = OrtEncoder(enc_path, OrtSettings(threads=1, spinning=False), io_binding=io_binding)
    tokens = random_encoder_inputs(flow.encoder.config, 2, 11, seed=0)
    with torch.no_grad():
        ref = flow.encoder(*tokens)
    for r, g in zip(ref, enc(*tokens)):
        torch.testing.assert_close(g, r, atol=5e-5, rtol=0)


def test_ort_buffer_is_reused_unless_copied(onnx_files):
    flow, est_path, _ = onnx_files[False]
    inputs = make_estimator_inputs(flow.estimator, 2, 16)
    shared = OrtEstimator(est_path, OrtSettings(threads=1), io_binding=True)
    a = shared(EstimatorInputs(**inputs))
    b = shared(EstimatorInputs(**{**inputs, "x": inputs["x"] + 1}))
    assert a.data_ptr() == b.data_ptr(), "the velocity buffer should be reused while the shape stays"
    own = OrtEstimator(est_path, OrtSettings(threads=1), io_binding=True, copy_outputs=True)
    c = own(EstimatorInputs(**inputs))
    d = own(EstimatorInputs(**{**inputs, "x": inputs["x"] + 1}))
    assert c.data_ptr() != d.data_ptr() and not torch.equal(c, d)


def test_engine_over_ort_equals_engine_over_torch(onnx_files):
    """The benchmark's path (b): the same streaming engine with both networks in ONNX Runtime."""
    flow, est_path, enc_path = onnx_files[False]
    engine = StreamingEngine(OrtEncoder(enc_path, threads=1), OrtEstimator(est_path, threads=1), n_feats=80,
                             meanflow=False)
    u = demo_utterance(1.6, seed=9, noise_seed=2)
    sizes = [8, 12, 20]
    [got] = stream_in_process(engine, [u], [sizes])
    [ref] = stream_in_process(make_engine(flow), [u], [sizes])
    for g, r in zip(got, ref):
        assert g.frame_offset == r.frame_offset
        np.testing.assert_allclose(g.mel, r.mel, atol=5e-4, rtol=0)


@pytest.mark.parametrize("meanflow", [False, True])
def test_cpu_rewrite_replaces_every_mish_and_attention_and_keeps_the_function(onnx_files, meanflow):
    import onnx

    from s3flow.runtime.ort_rewrite import rewrite_for_cpu

    flow, est_path, _ = onnx_files[meanflow]
    model = onnx.load(str(est_path))
    ops = [n.op_type for n in model.graph.node]
    counts = rewrite_for_cpu(model)
    assert (counts.mish, counts.attention) == (ops.count("Softplus"), ops.count("Softmax"))
    assert counts.attention == 4, "small config: 4 transformer stages of 1 block"
    after = [n.op_type for n in model.graph.node]
    assert "Softplus" not in after and "Softmax" not in after and after.count("MultiHeadAttention") == 4
    onnx.checker.check_model(model)
    plain = OrtEstimator(est_path, OrtSettings(threads=1, rewrite=False))
    fast = OrtEstimator(est_path, OrtSettings(threads=1))
    assert fast.model.rewrites == counts and plain.model.rewrites.attention == 0
    # attention is fused by default only in 1-thread sessions; Mish always
    two = OrtEstimator(est_path, OrtSettings(threads=2))
    assert (two.model.rewrites.mish, two.model.rewrites.attention) == (counts.mish, 0)
    assert OrtEstimator(est_path, OrtSettings(threads=2, fuse_attention=True)).model.rewrites == counts
    inputs = make_estimator_inputs(flow.estimator, 3, 41, seed=5)   # padded rows: the key mask matters
    with torch.no_grad():
        ref = flow.estimator(**inputs)
    bundle = EstimatorInputs(**inputs)
    torch.testing.assert_close(fast(bundle), ref, atol=5e-5, rtol=0)
    torch.testing.assert_close(fast(bundle), plain(bundle), atol=2e-5, rtol=0)


def test_auto_threads_share_the_cores_among_a_models_instances():
    from s3flow.runtime.ort import auto_threads

    assert auto_threads(1, cores=8) == 8 and auto_threads(2, cores=8) == 4 and auto_threads(3, cores=8) == 2
    assert auto_threads(4, cores=2) == 1 and auto_threads(0, cores=2) == 2
    assert auto_threads() >= 1


def test_keys_kept_from_an_earlier_call_grow_attention_alone():
    """Issue 50's count: queries attending to more keys (kept keys and values) cost attention in proportion to the
    keys, and nothing else."""
    from s3flow.model.estimator import EstimatorConfig
    from s3flow.model.flops import estimator_flops

    config = EstimatorConfig.full()
    alone, kept = estimator_flops(config, 2, 100), estimator_flops(config, 2, 100, key_frames=300)
    assert estimator_flops(config, 2, 100, key_frames=100) == alone
    assert kept.linear == alone.linear and kept.conv == alone.conv
    assert 2.9 < kept.attention / alone.attention <= 3.0
