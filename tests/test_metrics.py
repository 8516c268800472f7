"""The solver's metrics (``s3flow.serving.metrics``) and the warm start (``s3flow.serving.warmup``).

Without a server: what ``SolverBook`` observes for chunks run by a real ``StreamingEngine`` over stand-in
networks (counted independently: the engine's own call counter, the frames returned), the Prometheus text
parser on Triton-shaped text, the warm-up configs (parsed as ``ModelConfig``) and the solver's warm-up
leaving no state. Against a real server (``server`` marker): every model warmed up before the first request
(Triton's execution counts, the stubs' log lines) and the histograms in ``/metrics`` after a short load,
their counts equal to what the client received.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from s3flow_contract.tensors import ENCODER_INPUTS, VOCAB_SIZE, XVECTOR_DIM, names, request_arrays
from s3flow.engine.observer import NO_OBSERVER, Observer, Observers
from s3flow.engine.settings import ChunkSolving
from s3flow.engine.streaming import StreamingEngine
from s3flow.protocol import RequestRules, parse_request
from s3flow.server import metrics_reader as mr
from s3flow.serving import metrics as m
from s3flow.serving.warmup import warm_up_solver
from s3flow.repository.warmup_samples import (WARMUP_ITERATIONS, encoder_warmup, estimator_warmup, solver_set_up,
                                              write_model_warmup)

N_FEATS = 8


def _zero_velocity(inputs):
    return torch.zeros_like(inputs.x)


def _engine(meanflow: bool = False, observer: Observer = NO_OBSERVER, estimate=_zero_velocity) -> StreamingEngine:
    def encode(tokens, token_len, embedding):
        b, t = tokens.shape[0], 2 * tokens.shape[1]
        return torch.zeros(b, N_FEATS, t), torch.ones(b, 1, t), torch.ones(b, N_FEATS)  # spks of a real speaker

    return StreamingEngine(encode, estimate, n_feats=N_FEATS, meanflow=meanflow,
                           solving=ChunkSolving(max_utterance_frames=1000), observer=observer)


def _request(start: bool, end: bool, tokens: int, steps: int, rate=None, seed: int = 0):
    rng = np.random.default_rng(seed)
    speech_tokens, options = rng.integers(0, VOCAB_SIZE, tokens), {}
    if start:
        options = dict(prompt_tokens=rng.integers(0, VOCAB_SIZE, 5), prompt_mel=np.zeros((10, N_FEATS)),
                       speaker_embedding=np.ones(XVECTOR_DIM), n_timesteps=steps, guidance_rate=rate)
    inputs = request_arrays(speech_tokens, start=start, **options)
    return parse_request(inputs, start=start, end=end, rules=RequestRules(), n_feats=N_FEATS)


class Recorder:
    def __init__(self):
        self.seen = []

    def __call__(self, family, value, labels):
        self.seen.append((family.name, value, labels))

    def values(self, name):
        return [v for n, v, _ in self.seen if n == name]


@pytest.mark.parametrize("meanflow, rate, per_step", [(False, None, 2), (False, 0.0, 1), (True, None, 1)])
def test_book_observes_each_answered_chunk_and_each_euler_step(meanflow, rate, per_step):
    rec = Recorder()
    book = m.SolverBook(rec)
    engine = _engine(meanflow, observer=book)
    steps = 3
    # execute 1: two sequences start together (one batch); execute 2: one goes on, one ends
    first = engine.run([engine.admit(1, _request(True, False, 12, steps, rate)),
                        engine.admit(2, _request(True, False, 20, steps, rate, seed=1))])
    assert book.flush(0.01) == 2
    calls_after_first = engine.estimator_calls
    second = engine.run([engine.admit(1, _request(False, False, 8, steps)),
                         engine.admit(2, _request(False, True, 4, steps))])
    assert book.flush(0.01) == 2

    frames = [r.mel.shape[1] for r in first + second]
    assert rec.values("s3flow_chunk_frames") == frames == [2 * 12 - 6, 2 * 20 - 6, 8 * 2, 4 * 2 + 6]
    assert rec.values("s3flow_chunk_nfe") == [steps * per_step] * 4
    assert len(rec.values("s3flow_chunk_seconds")) == 4
    assert len(rec.values("s3flow_first_chunk_seconds")) == 2, "START chunks only"
    # one observation per estimator call (the engine's own count), each of 2 sequences
    assert rec.values("s3flow_step_batch_size") == [2] * engine.estimator_calls
    assert engine.estimator_calls == 2 * steps == 2 * calls_after_first


def _table_and_book(start_buffer_s: float):
    """A sequence table on a clock the test moves (its playback clocks: players with ``start_buffer_s``), and a
    book publishing what its commits say, answer by answer."""
    from s3flow.engine.playback import PlaybackSettings
    from s3flow.engine.sequences import SequenceLimits, SequenceTable

    rec, now = Recorder(), [0.0]
    table = SequenceTable(SequenceLimits(), clock=lambda: now[0], playback=PlaybackSettings(start_buffer_s=start_buffer_s))
    book = m.SolverBook(rec)

    def answer(at: float, *chunks):
        now[0] = at
        for corr_id, start, frames in chunks:
            if start:
                table.begin(corr_id, object())
            else:
                table.serve(corr_id)
            book.chunk_answered(corr_id, start, 2, frames, table.commit(corr_id, end=False, frames=frames))
        book.flush(0.0)

    return table, rec, answer


def test_the_table_follows_each_streams_lead_over_a_real_time_player_and_the_book_counts_underruns_once():
    """A player with no buffer here (the leads are the plain arithmetic); the next test gives it one."""
    table, rec, answer = _table_and_book(start_buffer_s=0.0)
    answer(0.0, (1, True, 14), (2, True, 14))     # 0.28 s of audio each
    answer(0.2, (1, False, 40))                   # stream 1: 0.28 s delivered, 0.2 s played: lead 0.08
    answer(0.5, (2, False, 40))                   # stream 2: 0.28 s delivered, 0.5 s played: dry
    answer(1.3, (2, False, 40), (1, False, 10))   # 2: 1.08 - 1.3 < 0 again (counted once); 1: 1.08 - 1.3
    lead = rec.values("s3flow_stream_lead_seconds")
    assert lead == pytest.approx([0.08, -0.22, -0.22, -0.22])
    assert rec.values("s3flow_stream_underruns_total") == [1, 1], "once per stream"
    assert table.lead(1) == pytest.approx(1.28 - 1.3) and table.deadline(1) == pytest.approx(1.28)
    table.end(1, "idle")
    assert 1 not in table and table.works().keys() == {2}, "a dropped stream is not followed any more"


def test_a_player_buffer_is_what_a_listener_hears_before_a_gap():
    """The default player starts 0.3 s after the first answer: an answer 0.2 s late against the bare arithmetic
    is still in time; 0.4 s late is a gap, counted."""
    from s3flow.engine.playback import PlaybackSettings

    assert PlaybackSettings().start_buffer_s == 0.3
    table, rec, answer = _table_and_book(start_buffer_s=0.3)
    answer(0.0, (1, True, 25), (2, True, 25))     # 0.5 s of audio each
    answer(0.7, (1, False, 25))
    answer(0.9, (2, False, 25))
    assert rec.values("s3flow_stream_lead_seconds") == pytest.approx([0.1, -0.1])
    assert rec.values("s3flow_stream_underruns_total") == [1], "stream 2 only"


def test_the_table_forgets_a_stream_at_its_end_and_lists_it_as_ended_for_a_while():
    """An END answered takes the stream out of the table (1,000 utterances grew the solver by 0.07 MiB per 100
    while a second book in the metrics kept up to 4,096 ended streams) and lists it for the vocoder for
    ``ENDED_GRACE_S``; a stream dropped before its END is not listed."""
    from s3flow.engine.sequences import ENDED_GRACE_S

    table, rec, answer = _table_and_book(start_buffer_s=0.0)
    answer(0.0, (1, True, 14), (2, True, 14))
    table.serve(1)
    assert table.commit(1, end=True, frames=20).lead == pytest.approx(0.28)
    table.end(2, "cancelled")
    assert len(table) == 0 and table.works() == {}
    assert table.recently_ended() == [1]
    answer(ENDED_GRACE_S + 0.1, (3, True, 14))
    assert table.recently_ended() == [], "forgotten after the grace"


def test_book_observes_nothing_for_a_failed_run_and_counts_drops_by_reason():
    rec, heard = Recorder(), []
    book = m.SolverBook(rec, on_drop=lambda corr_id, reason: heard.append((corr_id, reason)))

    def broken(inputs):
        raise RuntimeError("estimator away")

    engine = _engine(observer=book, estimate=broken)
    with pytest.raises(RuntimeError):
        engine.run([engine.admit(1, _request(True, False, 12, 2))])
    assert book.flush(0.0) == 0
    assert [n for n, _, _ in rec.seen] == ["s3flow_step_batch_size"], "the step was tried, no chunk answered"
    # drops reach the book as the engine's observer, by reason: from the engine's sequence table (an idle
    # eviction, the clock far ahead) and as the session reports them (a failed chunk's "error")
    engine.estimator = _zero_velocity
    engine.run([engine.admit(2, _request(True, False, 12, 2))])
    engine.sequences.clock = lambda: 1e12
    assert engine.sequences.evict_idle() == [2]
    engine.observer.sequence_dropped(4, "error")
    assert rec.seen[-2:] == [("s3flow_sequences_dropped_total", 1, {"reason": "idle"}),
                             ("s3flow_sequences_dropped_total", 1, {"reason": "error"})]
    assert heard == [(2, "idle"), (4, "error")], "on_drop hears of every drop too (the model's log line)"


class _Steps(Observer):
    def __init__(self):
        self.seen = []

    def estimator_step(self, sequences, rows, frames):
        self.seen.append((sequences, rows, frames))


@pytest.mark.parametrize("meanflow, rate, utterances, rows", [(False, None, 3, 6), (False, 0.0, 6, 6),
                                                              (True, None, 5, 5)])
def test_the_engine_reports_each_steps_batch_in_sequences_not_rows(meanflow, rate, utterances, rows):
    """The step batch size is the number of utterances solved together: a guided batch of B is one estimator
    call of 2B rows (conditional and unconditional halves) and counts B; an unguided one counts its rows."""
    rec, steps, calls = Recorder(), _Steps(), []

    def estimate(inputs):
        calls.append((inputs.x.shape[0], inputs.x.shape[2]))
        return torch.zeros_like(inputs.x)

    engine = _engine(meanflow, observer=Observers(m.SolverBook(rec), steps), estimate=estimate)
    n_steps = 2
    engine.run([engine.admit(i, _request(True, False, 10 + 2 * i, n_steps, rate, seed=i)) for i in range(utterances)])
    assert [b for b, _ in calls] == [rows] * n_steps, "one padded batch per Euler step"
    assert rec.values("s3flow_step_batch_size") == [utterances] * n_steps
    assert steps.seen == [(utterances, b, t) for b, t in calls], "rows and padded frames as the estimator saw"


TRITON_TEXT = """\
# HELP s3flow_chunk_seconds seconds a chunk spent in the solver's execute
# TYPE s3flow_chunk_seconds histogram
s3flow_chunk_seconds_count{instance="cfm_solver_0_0",model="cfm_solver"} 3
s3flow_chunk_seconds_sum{instance="cfm_solver_0_0",model="cfm_solver"} 0.75
s3flow_chunk_seconds_bucket{instance="cfm_solver_0_0",model="cfm_solver",le="0.1"} 1
s3flow_chunk_seconds_bucket{instance="cfm_solver_0_0",model="cfm_solver",le="0.5"} 2
s3flow_chunk_seconds_bucket{instance="cfm_solver_0_0",model="cfm_solver",le="+Inf"} 3
# HELP s3flow_sequences_dropped_total sequence states dropped
# TYPE s3flow_sequences_dropped_total counter
s3flow_sequences_dropped_total{instance="cfm_solver_0_0",model="cfm_solver",reason="idle"} 2
s3flow_sequences_dropped_total{instance="cfm_solver_0_0",model="cfm_solver",reason="failed END"} 1
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="cfm_solver",version="1"} 9
"""


def test_parser_reads_histograms_and_counters_of_triton_text():
    metrics = mr.parse_metrics(TRITON_TEXT)
    assert mr.metric_sum(metrics, "s3flow_sequences_dropped_total") == 3
    assert mr.metric_sum(metrics, "s3flow_sequences_dropped_total", reason="failed END") == 1
    assert not any(name.startswith("nv_") for name, _ in metrics), "prefix filter"
    h = mr.histogram(metrics, "s3flow_chunk_seconds", model="cfm_solver")
    assert (h.count, h.sum, h.buckets) == (3, 0.75, {0.1: 1, 0.5: 2, float("inf"): 3})
    assert (h.quantile(0.3), h.quantile(0.5), h.quantile(0.99)) == (0.1, 0.5, float("inf"))
    assert mr.histogram(metrics, "s3flow_chunk_seconds", model="other").count == 0


def test_families_follow_prometheus_naming():
    for f in m.FAMILIES:
        assert f.name.startswith("s3flow_") and (f.kind != "counter" or f.name.endswith("_total")), f
        if f.kind == "histogram":   # a histogram of seconds has seconds' buckets (a gauge may be a rate of them)
            assert ("seconds" in f.name) == (f.buckets in (m.SECONDS_BUCKETS, m.LEAD_BUCKETS)), f
        assert list(f.buckets) == sorted(set(f.buckets)), f"{f.name}: buckets must rise"


def test_warmup_configs_parse_and_carry_valid_requests(tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from s3flow.repository.model_config import write_config
    from s3flow.repository.configs import stateless_config
    from s3flow.repository.settings import RepositorySettings

    for meanflow in (False, True):
        repo = tmp_path / f"mf{meanflow}"
        for name in ("flow_encoder", "estimator"):
            (repo / name).mkdir(parents=True)
            write_config(repo / name, stateless_config(name, 80, meanflow, RepositorySettings(), 1))
        files = write_model_warmup(repo, 80, meanflow)
        for name in ("flow_encoder", "estimator"):
            config = text_format.Parse((repo / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
            [sample] = config.model_warmup
            assert sample.count == WARMUP_ITERATIONS and sample.batch_size == 1
            assert set(sample.inputs) == {i.name for i in config.input}, "every input, nothing else"
            for key, spec in sample.inputs.items():
                if spec.input_data_file:  # a data file holds exactly the tensor's bytes
                    data = (repo / name / "warmup" / spec.input_data_file).read_bytes()
                    itemsize = {"TYPE_INT64": 8, "TYPE_FP32": 4}[model_config_pb2.DataType.Name(spec.data_type)]
                    assert len(data) == itemsize * int(np.prod(spec.dims)), (name, key)
        enc = text_format.Parse((repo / "flow_encoder" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        tokens = enc.model_warmup[0].inputs["tokens"]
        length = np.frombuffer((repo / "flow_encoder" / "warmup" / "token_len").read_bytes(), np.int64)
        assert tokens.zero_data and list(length) == [tokens.dims[1]], "token ids 0 (valid), the true length"
        assert all(p.exists() for p in files)
        with pytest.raises(ValueError, match="model_warmup already"):
            write_model_warmup(repo, 80, meanflow)
    assert set(encoder_warmup()[0].inputs) == set(names(ENCODER_INPUTS))
    assert "r" in estimator_warmup(8, True)[0].inputs and "r" not in estimator_warmup(8, False)[0].inputs


@pytest.mark.parametrize("meanflow", [False, True])
def test_solver_warm_up_runs_the_served_path_and_leaves_no_state(meanflow):
    engine = _engine(meanflow)
    engine.admit(5, _request(True, False, 10, 2))  # a live sequence of the served engine
    report = warm_up_solver(engine)
    assert report.chunks == 2 and report.calls >= 2 * (1 + 2)  # 2 encoder calls, >= 2 Euler steps each
    assert 5 in engine.sequences and len(engine.sequences) == 1 and engine.estimator_calls == 0, \
        "the served engine untouched"


def test_vocoder_warm_up_runs_both_networks():
    from s3flow.engine.vocoder_stream import StreamSettings, VocoderStream
    from s3flow.model.vocoder_source import SourceParams
    from s3flow.serving.warmup import warm_up_vocoder

    calls = {"f0": 0, "decode": 0}

    def f0(mel):
        calls["f0"] += 1
        return np.full(mel.shape[::2], 100.0)

    def decode(mel, harmonics):
        calls["decode"] += 1
        return np.zeros((1, harmonics.shape[2]), np.float32)

    stream = VocoderStream(f0, decode, SourceParams(), StreamSettings(), n_feats=80)
    report = warm_up_vocoder(stream)
    assert report.chunks == 2 and calls["f0"] >= 1 and calls["decode"] >= 1


def test_vocoder_calibration_prices_its_pushes_and_keeps_a_saved_price():
    """``calibrate_vocoder``: the default chunks of a 4 s utterance, every push timed into the cost fit, the audio
    over the time the prior capacity; a price saved by an earlier server is left as it is."""
    import time

    from s3flow.engine.capacity import CapacityModel
    from s3flow.engine.vocoder_stream import StreamSettings, VocoderStream
    from s3flow.model.vocoder_source import SourceParams
    from s3flow.serving.warmup import VOCODER_CALIBRATION_S, calibrate_vocoder

    def decode(mel, harmonics):
        time.sleep(0.002 + 2e-4 * mel.shape[-1])   # a push's cost: fixed + per frame
        return np.zeros((1, harmonics.shape[2]), np.float32)

    stream = VocoderStream(lambda mel: np.full(mel.shape[::2], 100.0), decode, SourceParams(), StreamSettings(),
                           n_feats=80)
    model = CapacityModel(max_batch=1, duty_prior=None)
    report = calibrate_vocoder(stream, model)
    assert report.chunks >= 3 and model.estimator.calls == report.chunks
    assert model.costs().known and model.estimator.per_unit > 0
    # 4 s of audio (200 frames) at >= 2e-4 s a frame plus 2 ms a push: at most ~90 audio s per s, and not far under
    assert VOCODER_CALIBRATION_S / report.seconds == pytest.approx(model.prior_capacity, rel=0.05)
    assert 10 < model.prior_capacity < 100
    saved = CapacityModel(max_batch=1, duty_prior=None)
    saved.prior_capacity = 3.0
    calibrate_vocoder(stream, saved)
    assert saved.prior_capacity == 3.0
    sealed = []   # the snapshot a served push seals after each chunk but the END: timed with its push

    def seal(state):   # (0.1 s: at 0.02 s a loaded host's jitter priced the sealed pushes above the plain ones once)
        sealed.append(state)
        time.sleep(0.1)
    sealing = CapacityModel(max_batch=1, duty_prior=None)
    with_seal = calibrate_vocoder(stream, sealing, seal=seal)
    assert len(sealed) == with_seal.chunks - 1
    assert with_seal.seconds >= 0.1 * len(sealed), "the seal is timed with its push"
    assert sealing.prior_capacity < model.prior_capacity


# ------------------------------------------------------------------------------------------ real server
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from s3flow.server.triton_server import TritonServer
    from s3flow_tools.bench.repos import warmup_repository

    root = tmp_path_factory.mktemp("metrics")
    repo = warmup_repository(root, warmup=True)
    with TritonServer(repo, log_file=root / "server.log", background_stop=True) as server:
        server.log_path = root / "server.log"
        yield server


@pytest.mark.server
def test_every_model_warmed_up_before_the_first_request(served):
    from s3flow.serving.warmup import VOCODER_WARMUP_FRAMES
    from s3flow_tools.bench.served import model_stats

    import re
    import time

    t0 = time.monotonic()   # the solver's calibration (s3flow.serving.calibration) calls them too, once, at load
    while "cfm_solver: calibration" not in served.log_path.read_text():
        assert time.monotonic() - t0 < 60, "the solver never calibrated"
        time.sleep(0.2)
    log = served.log_path.read_text()
    [calibration] = re.findall(r"cfm_solver: calibration: \d+ chunks, (\d+) network calls", log)
    stats = model_stats(served.client())
    assert stats["estimator"][0] == WARMUP_ITERATIONS + int(calibration), stats
    assert stats["flow_encoder"][0] > WARMUP_ITERATIONS, stats
    # the stateful models got no request but the solver's set-up probe (answered empty: READY 0, no state)
    assert stats["cfm_solver"][0] == solver_set_up()[0].count and stats["vocoder"][0] == 0, stats
    assert log.count("cfm_solver: warm-up: 2 chunks") == 1, "the solver warmed up once, in initialize"
    assert log.count(f"vocoder: warm-up: {len(VOCODER_WARMUP_FRAMES)} chunks") == 1
    metrics = mr.read_metrics(f"127.0.0.1:{served.metrics_port}")
    assert mr.metric_sum(metrics, "s3flow_chunk_seconds_count") == 0, "warm-up is not counted as traffic"
    live = [v for (name, _), v in metrics.items() if name == "s3flow_live_sequences"]
    assert live == [0], "the gauge shows from the load on, at 0"


@pytest.mark.server
def test_histograms_show_in_metrics_during_a_short_load(served):
    from s3flow_tools.bench import load as load_test

    before = mr.read_metrics(f"127.0.0.1:{served.metrics_port}")
    steps = 2
    report = load_test.run_load(served.grpc_url, streams=3, utterances=2, steps=steps, time_limit_s=120,
                                check_outputs=0, metrics_url=f"127.0.0.1:{served.metrics_port}")
    assert report.ok, (report.errors, report.frame_errors)
    h = report.server_histograms
    assert set(h) == {f.name for f in m.HISTOGRAMS}
    assert h["s3flow_chunk_seconds"].count == report.chunks and h["s3flow_first_chunk_seconds"].count == 6
    assert h["s3flow_chunk_nfe"].sum == report.chunks * steps * 2, "guided: 2 evaluations per Euler step"
    frames = sum(2 * len(load_test.load_utterance(i, steps).speech_tokens) for i in range(6))
    assert h["s3flow_chunk_frames"].sum == frames
    batch = h["s3flow_step_batch_size"]
    assert batch.sum == steps * report.chunks, "each chunk in each of its Euler steps' batches"
    assert batch.count >= steps * report.chunks / 3, "at most 3 sequences in one step"
    for family in m.HISTOGRAMS:  # cumulative buckets ending in +Inf == count, the family's own bounds
        buckets = h[family.name].buckets
        assert sorted(buckets) == sorted([*map(float, family.buckets), float("inf")])
        counts = [buckets[le] for le in sorted(buckets)]
        assert counts == sorted(counts) and counts[-1] == h[family.name].count
    after = mr.read_metrics(f"127.0.0.1:{served.metrics_port}")
    assert mr.metric_sum(after, "s3flow_chunk_seconds_count") - mr.metric_sum(before, "s3flow_chunk_seconds_count") \
        == report.chunks
