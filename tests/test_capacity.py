"""The capacity model (s3flow.engine.capacity), its load reports (s3flow.serving.load) and the calibration's plan,
without a server: the fits recover known costs, a stream is priced against the plan, the capacity is where N
streams fill the device, the measured capacity follows the work (busy time and audio made) and nothing else, and
the reports sum across instances."""
import dataclasses
import time

import numpy as np
import pytest
import torch

from s3flow_contract.tensors import LOOKAHEAD_FRAMES
from s3flow.engine.capacity import DUTY_PRIOR, WINDOW_S, CapacityModel, Costs, CostFit, Work, default_plan
from s3flow.engine.settings import SolverSettings
from s3flow.engine.streaming import StreamingEngine
from s3flow.protocol import RequestRules, parse_request
from s3flow.serving.calibration import planned_start
from s3flow.serving.load import InstanceLoad, LoadBoard, LoadReport

PLAN, STEPS, ROWS = planned_start(SolverSettings(), n_feats=80, meanflow=False)


def plan_sizes() -> list[int]:
    """The plan's chunk sizes (tokens): the first chunk's frames are its tokens' less the lookahead held back."""
    return [(w.frames + (LOOKAHEAD_FRAMES if k == 0 else 0)) // 2 for k, w in enumerate(PLAN.chunks)]


def works_after_each_chunk(engine: StreamingEngine, chunks: int):
    """The plan's first ``chunks`` chunk sizes streamed as one utterance through ``engine`` (a 6 s prompt, never
    ended): the stream's work after each answer."""
    rng = np.random.default_rng(2)
    for k, n in enumerate(plan_sizes()[:chunks]):
        inputs = {"speech_tokens": rng.integers(0, 6561, (1, n), dtype=np.int64)}
        if k == 0:
            inputs.update(prompt_tokens=rng.integers(0, 6561, (1, 150), dtype=np.int64),
                          prompt_mel=np.zeros((1, 300, 80), np.float32), speaker_embedding=np.ones((1, 192), np.float32))
        engine.run([engine.admit(1, parse_request(inputs, start=k == 0, end=False,
                                                  rules=RequestRules(max_chunk_tokens=200), n_feats=80))])
        yield engine.sequences.works()[1]


def stand_in_engine(observer=None) -> StreamingEngine:
    """The served engine over zero networks (what the plan is made with)."""
    def encode(tokens, token_len, embedding):
        return torch.zeros(tokens.shape[0], 80, 2 * tokens.shape[1]), None, torch.zeros(tokens.shape[0], 80)

    kw = {} if observer is None else {"observer": observer}
    return StreamingEngine(encode, lambda inputs: torch.zeros_like(inputs.x), n_feats=80, meanflow=False, **kw)


def test_the_fit_recovers_a_fixed_and_a_per_unit_cost_and_follows_a_change():
    fit, rng = CostFit(halflife=20), np.random.default_rng(0)
    for _ in range(200):
        units = rng.integers(100, 5000)
        fit.observe(units, 0.004 + 2e-6 * units)
    assert fit.fixed == pytest.approx(0.004, rel=1e-6) and fit.per_unit == pytest.approx(2e-6, rel=1e-6)
    for _ in range(200):                       # the host got twice as slow: old calls are forgotten
        units = rng.integers(100, 5000)
        fit.observe(units, 2 * (0.004 + 2e-6 * units))
    assert fit.fixed == pytest.approx(0.008, rel=1e-3) and fit.per_unit == pytest.approx(4e-6, rel=1e-3)
    flat = CostFit()
    for units in (100, 200, 300):              # time that does not grow with size: a fixed cost alone
        flat.observe(units, 0.01 - 1e-6 * units)
    assert flat.per_unit == 0 and flat.fixed > 0


def test_the_fit_prices_a_cached_key_apart_from_a_frame_solved_where_the_calls_separate_them():
    """Issue 50 step 5: calls reading caches of several lengths give the three parts back; calls that never read
    one, or always read one in the same proportion, price a key at the prior share of a frame (and still price
    those calls right); a key dearer than a frame solved (noise) is not believed."""
    rng = np.random.default_rng(3)
    apart = CostFit()
    for _ in range(300):
        units, keys = rng.integers(100, 5000), rng.choice([0, 100, 200, 400])
        apart.observe(units, 0.004 + 2e-6 * units + 3e-7 * keys, keys=keys)
    assert (apart.fixed, apart.per_unit, apart.per_key) == pytest.approx((0.004, 2e-6, 3e-7), rel=1e-6)
    assert apart.seconds(1000, keys=200) == pytest.approx(0.004 + 2e-3 + 6e-5)
    never = CostFit(key_prior=0.1)
    together = CostFit(key_prior=0.1)
    for _ in range(300):
        units = rng.integers(100, 5000)
        never.observe(units, 0.004 + 2e-6 * units)
        together.observe(units, 0.004 + 2e-6 * units + 3e-7 * units / 2, keys=units / 2)
    assert (never.fixed, never.per_unit, never.per_key) == pytest.approx((0.004, 2e-6, 2e-7), rel=1e-6)
    assert together.per_key == pytest.approx(0.1 * together.per_unit)
    assert together.seconds(1000, keys=500) == pytest.approx(0.004 + 2e-3 + 1.5e-4, rel=1e-6)
    dear = CostFit(key_prior=0.1)
    for _ in range(300):
        units, keys = rng.integers(100, 5000), rng.choice([0, 100, 200, 400])
        dear.observe(units, 0.004 + 2e-6 * units + 5e-6 * keys, keys=keys)
    assert dear.per_key == pytest.approx(0.1 * dear.per_unit)


def test_a_stream_reading_its_kept_prompt_reports_the_keys_its_plan_counts():
    """A stream that keeps its prompt's cache (keep_solved 1) reads it in every chunk after its first: its work
    counts those cached keys (rows x prompt frames x steps) as its plan does, and every estimator call reports the
    cache's frames to the capacity model, whose fit prices them (issue 50 step 5)."""
    from s3flow.engine.observer import Observer
    from s3flow.engine.planning import ZeroEstimator

    settings = SolverSettings().replace(keep_solved=1)
    plan, _, _ = planned_start(settings, n_feats=80, meanflow=False)
    assert plan.chunks[0].key_row_frames == 0 and all(w.key_row_frames > 0 for w in plan.chunks[1:])

    class Timed(Observer):
        def __init__(self):
            self.pasts = []

        def estimator_timed(self, rows, frames, seconds, past=0):
            self.pasts.append(past)

    def encode(tokens, token_len, embedding):
        return torch.zeros(tokens.shape[0], 80, 2 * tokens.shape[1]), None, torch.zeros(tokens.shape[0], 80)

    timed = Timed()
    engine = StreamingEngine(encode, ZeroEstimator(), n_feats=80, meanflow=False, solving=settings.solving,
                             observer=timed)
    for k, work in enumerate(works_after_each_chunk(engine, 4)):
        assert work.key_row_frames == pytest.approx(plan.prefix(work.frames).key_row_frames), f"after chunk {k + 1}"
    prompt = settings.solving.prompt_frames
    assert timed.pasts == [0] * STEPS + [prompt] * 3 * STEPS
    model = CapacityModel()
    for past in (0, prompt):
        for frames in (50, 100, 200):
            model.estimator_timed(2, frames, 0.004 + 2e-6 * 2 * frames + 3e-7 * 2 * past, past)
    assert model.costs().step_seconds(2, 100, prompt) == pytest.approx(0.004 + 4e-4 + 6e-7 * prompt)


def test_the_default_plan_is_the_clients_schedule_and_the_plan_ends_on_whole_chunks():
    from s3flow_client.chunking import chunk_schedule
    assert default_plan(8.0) == chunk_schedule(200)
    sizes = plan_sizes()
    assert sizes[:5] == [10, 20, 40, 80, 100] and set(sizes[4:]) == {100}
    assert [w.frames for w in PLAN.chunks][:3] == [20 - LOOKAHEAD_FRAMES, 40, 80], \
        "each chunk's frames are those its answer makes final (the first holds its lookahead back)"
    assert STEPS == 10 and ROWS == 2 and PLAN.expected_frames == 250
    assert all(w.steps == STEPS and w.chunks == 1 for w in PLAN.chunks)


def test_a_plan_counts_the_estimator_calls_the_engine_really_makes():
    """plan_work over stand-in networks against a StreamingEngine run that records its calls."""
    calls = []

    def encode(tokens, token_len, embedding):
        return torch.zeros(tokens.shape[0], 80, 2 * tokens.shape[1]), None, torch.zeros(tokens.shape[0], 80)

    def estimate(inputs):
        calls.append(inputs.x.shape[0] * inputs.x.shape[2])
        return torch.zeros_like(inputs.x)

    engine = StreamingEngine(encode, estimate, n_feats=80, meanflow=False)
    rng = np.random.default_rng(1)
    sizes = plan_sizes()
    for k, n in enumerate(sizes):
        inputs = {"speech_tokens": rng.integers(0, 6561, (1, n), dtype=np.int64)}
        if k == 0:
            inputs.update(prompt_tokens=rng.integers(0, 6561, (1, 150), dtype=np.int64),
                          prompt_mel=np.zeros((1, 300, 80), np.float32), speaker_embedding=np.ones((1, 192), np.float32))
        engine.run([engine.admit(1, parse_request(inputs, start=k == 0, end=k == len(sizes) - 1,
                                                  rules=RequestRules(max_chunk_tokens=200), n_feats=80))])
    assert sum(calls) == sum(w.row_frames for w in PLAN.chunks) and len(calls) == sum(w.steps for w in PLAN.chunks)


def test_a_stream_is_priced_against_the_plan_by_how_much_heavier_it_is():
    costs = Costs(0.005, 5e-5, 0.002, 5e-5, max_batch=8)
    planned = PLAN.start_need(costs, 4)                                  # a START: what its ramp needs
    assert PLAN.demand(costs, Work(), 4) == planned
    assert planned > 1.15 * costs.demand(PLAN.window(0), 4) > 1.15 ** 2 * costs.demand(PLAN.expected(), 4), \
        "a START needs more than its first 2 s per second of audio, and those more than the average"
    early = PLAN.prefix(60)                                              # its first chunk and half the second
    assert early.frames == 60 and PLAN.demand(costs, early, 4) == pytest.approx(costs.demand(PLAN.window(60), 4))
    heavy = Work(2 * early.row_frames, 2 * early.steps, early.chunks, early.encoder_tokens, early.frames)
    ratio = PLAN.demand(costs, heavy, 4) / PLAN.demand(costs, early, 4)
    assert 1.5 < ratio < 2, "twice the estimator work"
    long = PLAN.prefix(5000)                                            # far past the plan: its last chunk again
    assert long.frames == 5000 and PLAN.demand(costs, long, 4) == pytest.approx(costs.demand(PLAN.window(5000), 4))
    assert PLAN.demand(costs, long, 4) < 0.8 * planned, "an old stream in steady chunks is cheaper than a young one"


def test_a_start_is_priced_by_what_its_ramp_needs_each_chunk_within_the_buffer_and_the_audio_before_it():
    """Chunks 2..j of the plan must be made within the start-up buffer plus the audio of chunks 1..j-1 (the first
    is the first audio's wait): a START's price is the most any j asks, more than its first 2 s per second of audio
    when the chunks double; steady chunks of one size ask no more than their cost per second of audio."""
    costs = Costs(0.004, 6e-5, 0.002, 4e-5, max_batch=8)
    need, cost, audio = 0.0, 0.0, PLAN.chunks[0].frames / 50
    for w in PLAN.chunks[1:]:
        if audio * 50 >= PLAN.expected_frames:
            break
        cost += costs.seconds(w, 2)
        need = max(need, cost / (PLAN.start_buffer_s + audio))
        audio += w.frames / 50
    assert PLAN.start_need(costs, 2) == pytest.approx(need) and need > 1.2 * costs.demand(PLAN.window(0), 2)
    slower = dataclasses.replace(PLAN, start_buffer_s=1.5)
    assert slower.start_need(costs, 2) < PLAN.start_need(costs, 2), "a player that holds more asks less"
    assert PLAN.start_need(costs, 2, nfe_ratio=2.0) > 1.5 * PLAN.start_need(costs, 2), "twice the estimator work"
    last = PLAN.chunks[-1]
    steady = dataclasses.replace(PLAN, chunks=[last] * 12, expected_frames=10 * last.frames)
    assert steady.start_need(costs, 2) <= costs.demand(last, 2) + 1e-12


def test_capacity_is_where_n_streams_fill_the_device():
    planned = PLAN.expected()
    for costs in (Costs(0.005, 5e-5, 0.002, 5e-5, 8), Costs(0.05, 1e-6, 0.0, 0.0, 4), Costs(0.0, 2e-4, 0.0, 0.0, 8)):
        c = costs.capacity(planned)
        n = c   # streams of real-time playback: one second of audio per second each
        assert n * costs.demand(planned, costs.share(round(n))) == pytest.approx(1.0, rel=0.15), costs
    assert Costs().capacity(planned) == 0.0, "nothing measured, nothing claimed"


def _fitted(max_batch: int = 8, fixed: float = 0.001, per_unit: float = 1e-5) -> CapacityModel:
    model = CapacityModel(max_batch=max_batch)
    model.estimator_timed(2, 100, fixed + 200 * per_unit)
    model.estimator_timed(8, 100, fixed + 800 * per_unit)
    return model


def test_the_correction_is_busy_time_over_priced_work_in_a_window_of_recent_work():
    model = _fitted()
    assert model.correction is None and model.capacity() is None, "nothing served yet: the prior"
    assert model.costs().est_per_unit == pytest.approx(1e-5)
    work = Work(row_frames=1000, steps=5, chunks=1, encoder_tokens=0, frames=20)
    for _ in range(100):   # every busy stretch took 3x what its chunk is priced at
        model.estimator_step(1, 2, 100)
        model.chunk_work(1, work)
        model.worked(3 * model._costs(1.0).seconds(work, 1))
    assert model.correction == pytest.approx(3.0) and model.costs().est_fixed == pytest.approx(3 * 0.001)
    for _ in range(20000):  # the host got faster: the window forgets the old work
        model.chunk_work(1, work)
        model.worked(1.5 * model._costs(1.0).seconds(work, 1))
    assert model.correction == pytest.approx(1.5, rel=1e-3)


def test_the_capacity_is_the_measured_throughput_projected_to_full_batches():
    """One stream alone: the audio it made per busy second, times what sharing each call's fixed part by
    ``max_batch`` saves on that same work; at full batches the throughput itself. Idle time changes nothing, and
    nothing but the work moves it (no pressure from streams that ran dry)."""
    model = _fitted(fixed=0.01, per_unit=1e-5)
    work = Work(row_frames=2000, steps=10, chunks=1, encoder_tokens=0, frames=50)   # 1 s of audio per chunk
    for _ in range(50):
        model.estimator_step(1, 2, 100)
        model.chunk_work(1, work)
        model.worked(0.5)                            # one stream alone: 2 audio s per busy s
    assert model.throughput == pytest.approx(2.0)
    fits = model._costs(1.0)
    gain = fits.seconds(work, 1) / fits.seconds(work, 8)
    assert 1.5 < gain < 5 and model.capacity() == pytest.approx(2.0 * gain * DUTY_PRIOR, rel=1e-6), \
        "never at capacity yet: the prior share of wall time it is busy there"
    before = model.capacity()
    time.sleep(0.05)                                 # idle: nothing is measured, nothing moves
    assert model.capacity() == before
    for _ in range(int(20 * WINDOW_S)):              # full batches: 8 streams share every call
        model.estimator_step(8, 16, 100)
        for c in range(8):
            model.chunk_work(c, work)
        model.worked(8 * fits.seconds(work, 8) * 1.2)
    assert model.capacity() == pytest.approx(DUTY_PRIOR * model.throughput, rel=0.02)
    assert model.capacity() == pytest.approx(DUTY_PRIOR / (1.2 * fits.seconds(work, 8)), rel=0.02)
    vocoder_like = CapacityModel(max_batch=1, duty_prior=None)   # waits for the solver: its throughput alone
    vocoder_like.estimator_timed(1, 100, 0.01)
    vocoder_like.chunk_work(1, work)
    vocoder_like.worked(0.25, streams=5)
    assert vocoder_like.capacity() == pytest.approx(4.0)


def test_at_capacity_the_wall_time_the_instance_waits_for_the_rest_of_the_pipeline_counts():
    """Holding a full batch of streams the instance is the server at capacity: if it is busy only 70 % of the wall
    time there (hops, other processes on the device, the clients' round trips), it makes 0.7 of its busy-time
    throughput, and so it will at any later load; a fuller instance's idle stretches at low load do not count."""
    now = [0.0]
    model = _fitted(fixed=0.01, per_unit=1e-5)
    model.clock = lambda: now[0]
    work = Work(row_frames=2000, steps=10, chunks=1, encoder_tokens=0, frames=50)
    for _ in range(200):                             # low load: long idle gaps, not at capacity
        now[0] += 3.0
        model.estimator_step(1, 2, 100)
        model.chunk_work(1, work)
        model.worked(0.5, streams=1)
    alone = model.capacity()
    assert model._duty() == DUTY_PRIOR, "never at capacity yet"
    for _ in range(400):                             # 8 streams held, busy 0.7 of every second
        now[0] += 1.0
        model.estimator_step(8, 16, 100)
        for c in range(8):
            model.chunk_work(c, work)
        model.worked(0.7, streams=8)
    assert model._duty() == pytest.approx(0.7, rel=1e-3)
    assert model.capacity() == pytest.approx(0.7 * model.throughput, rel=0.02)
    assert model.capacity() == pytest.approx(8 * 1.0 / 0.7 * 0.7, rel=0.02), "8 s of audio per wall second"
    assert alone != model.capacity()


def test_the_capacity_model_keeps_no_book_that_grows_with_chunks_or_ended_streams():
    """What the vocoder and the step loop report between ``worked`` calls is summed, not listed; a stream's work
    is the sequence table's (it goes with the stream)."""
    model = _fitted()
    for c in range(5000):
        model.chunk_work(c, Work(row_frames=10, steps=1, chunks=1, frames=2))
    assert isinstance(model._made, Work) and model._made.chunks == 5000
    assert not [k for k, v in vars(model).items() if isinstance(v, (dict, list)) and len(v) > 10], "nothing listed"


def test_reports_sum_over_instances_and_price_pending_starts_with_the_streams(tmp_path):
    files = LoadBoard(tmp_path)
    model = _fitted(fixed=0.002, per_unit=2e-5)
    model.encoder_timed(100, 0.001)
    for c in (1, 2):
        model.chunk_work(c, PLAN.prefix(100))
    InstanceLoad(files, "cfm_solver_0", "solver", model, PLAN, STEPS, ROWS).publish(
        {1: PLAN.prefix(100), 2: PLAN.prefix(100), 3: Work()})   # 3: no answer yet
    vocoder = CapacityModel(max_batch=1)
    vocoder.estimator_timed(1, 100, 0.01)
    vocoder.chunk_work(1, Work(row_frames=100, steps=1, frames=100))
    InstanceLoad(files, "vocoder_0", "vocoder", vocoder).publish({1: Work(row_frames=100, steps=1, frames=100)})
    (tmp_path / "vocoder_1.tmp123").write_text("half written")
    load = files.read()
    assert load.known and load.solver_ids == {1, 2, 3} and len(load.reports) == 2
    costs = model.costs()
    assert load.capacity == pytest.approx(DUTY_PRIOR * costs.capacity(PLAN.expected())), \
        "before any work: the calibrated prior, times the busy share at capacity the live estimate applies"
    def streams(share):   # stream 3 has no answer yet: priced by the plan's start; against the prior's capacity
        return (2 * costs.demand(PLAN.window(100), share) + PLAN.start_need(costs, share)) / DUTY_PRIOR

    solver, vocoder = load.stages()
    assert (solver.name, vocoder.name) == ("solver", "vocoder")
    assert solver.now == pytest.approx(streams(4), rel=1e-6), "the calls shared with the START asking, as it will be"
    assert vocoder.now == pytest.approx(0.01 / 2)                                      # 0.01 s per 2 s of audio
    assert load.utilization() == pytest.approx(max(streams(3), 0.01 / 2), rel=1e-6), "the busiest stage, not the sum"
    assert load.utilization(pending=2) > load.utilization()
    assert solver.need == pytest.approx(PLAN.start_need(costs, 4) / DUTY_PRIOR, rel=1e-6)
    assert vocoder.need == pytest.approx(0.005 / 3, rel=1e-6), "a third of the streams vocode"
    def need(**kw):
        return load.stages(**kw)[0].need

    assert need(steps=10, guidance_rate=0.0) < 0.6 * solver.need and need(steps=20) > 1.8 * solver.need
    assert LoadReport.from_json(load.reports[0].to_json()) == load.reports[0]


def test_a_measured_capacity_rescales_every_solver_demand_and_token2wav_adds_the_vocoder(tmp_path):
    """N default streams need N / capacity of the device, whatever the fits say (they price one stream against
    another); token2wav's capacity adds the vocoder's device time to the solver's, in part
    (``load.VOCODER_OVERLAP``)."""
    from s3flow.serving.load import VOCODER_OVERLAP

    files = LoadBoard(tmp_path)
    model = _fitted(fixed=0.002, per_unit=2e-5)
    model.chunk_work(1, PLAN.prefix(100))
    solver = InstanceLoad(files, "s", "solver", model, PLAN, STEPS, ROWS)
    prior = solver.publish({1: PLAN.prefix(100)})
    model.estimator_step(1, 2, 100)
    model.chunk_work(2, PLAN.expected())
    model.worked(PLAN.expected().audio_s / 2.0)      # it made 2 audio s per busy s
    measured = solver.publish({1: PLAN.prefix(100)})
    assert measured.capacity == pytest.approx(model.capacity()) and measured.capacity != prior.capacity
    share = measured.costs.share(8)
    planned = measured.planned_demand(share) / PLAN.start_need(measured.costs, share)
    assert planned == pytest.approx(measured.planned_capacity / measured.capacity, rel=1e-6)
    vocoder = CapacityModel(max_batch=1, duty_prior=None)   # as the vocoder model makes it
    vocoder.estimator_timed(1, 100, 0.01)
    vocoder.chunk_work(1, Work(row_frames=100, steps=1, frames=100))   # 2 s of audio ...
    vocoder.worked(0.25)                                                # ... in 0.25 s: 8 audio s per s
    InstanceLoad(files, "v", "vocoder", vocoder).publish({1: Work(row_frames=100, steps=1, frames=100)})
    load = files.read()
    assert load.capacity == pytest.approx(measured.capacity)
    assert load.vocoder_capacity == pytest.approx(8.0)
    s, v = sorted((1 / measured.capacity, 1 / 8.0))
    assert load.wav_capacity == pytest.approx(1 / (v + VOCODER_OVERLAP * s)), "the vocoder's time adds, in part"


def test_token2wav_capacity_adds_part_of_the_vocoders_device_time_to_the_solvers(tmp_path):
    """Issue 48: one device runs the solver and the vocoder; each figure holds the other's time only in part. The
    solver's alone while the vocoder has no price."""
    from s3flow.serving.load import VOCODER_OVERLAP, LoadReport

    files = LoadBoard(tmp_path / "priced")
    files.write("s", LoadReport("solver", capacity=6.0))
    files.write("v", LoadReport("vocoder", capacity=12.0))
    load = files.read()
    assert load.wav_capacity == pytest.approx(1 / (1 / 6 + VOCODER_OVERLAP / 12)), "the larger time and a share of the other"
    assert 4.0 < load.wav_capacity < 6.0, "between the times added (4) and the smaller capacity (6)"
    assert load.wav_factor == pytest.approx(6.0 / load.wav_capacity)
    files = LoadBoard(tmp_path / "unpriced")
    files.write("s", LoadReport("solver", capacity=6.0))
    files.write("v", LoadReport("vocoder", capacity=0.0))
    assert files.read().wav_capacity == pytest.approx(6.0), "a vocoder with no price yet: the solver's alone"


def test_solver_instances_are_one_server_of_their_summed_capacity_and_a_start_goes_to_the_emptier(tmp_path):
    """Several solver instances (results/layout.md: the CPU default is two) each measure what they make while the
    others work beside them: the server's capacity is their sum, every stream's demand is against it wherever it
    is held (N default streams need N / capacity), and a START is priced on the instance that holds the fewest."""
    files, reports = LoadBoard(tmp_path), []
    for name, made_per_busy_s, held in (("cfm_solver_0", 2.0, {1: PLAN.prefix(100), 2: PLAN.prefix(100)}),
                                        ("cfm_solver_1", 3.0, {3: PLAN.prefix(100)})):
        model = _fitted(fixed=0.002, per_unit=2e-5)
        model.estimator_step(1, 2, 100)
        model.chunk_work(9, PLAN.expected())
        model.worked(PLAN.expected().audio_s / made_per_busy_s)
        reports.append(InstanceLoad(files, name, "solver", model, PLAN, STEPS, ROWS, cap=4).publish(held))
    load = files.read()
    first, second = reports
    assert load.capacity == pytest.approx(first.capacity + second.capacity) and load.cap == 8
    assert first.capacity != second.capacity, "two different instances: the weights below are not trivially equal"
    own = {r.capacity: r.utilization for r in reports}   # each instance's streams against its own capacity
    assert load.utilization() == pytest.approx(sum(u * c for c, u in own.items()) / load.capacity, rel=1e-6), \
        "each instance's share of the server's capacity, weighted by it"
    [solver] = load.stages()
    assert solver.need == pytest.approx(second.planned_demand(second.costs.share(2), capacity=load.capacity),
                                        rel=1e-6), "priced on the instance holding one stream, not two"
    assert solver.need < first.planned_demand(first.costs.share(3)), "not against one instance's capacity alone"


def test_the_wait_is_until_enough_streams_end_or_young_ones_leave_their_costly_start(tmp_path):
    files = LoadBoard(tmp_path)
    model = CapacityModel(max_batch=1)
    model.estimator_timed(1, 100, 0.01)
    model.chunk_work(1, PLAN.prefix(300))     # 6 s made of 8 expected: ends in about 2 s
    model.chunk_work(2, PLAN.prefix(50))      # 1 s made: ends in about 7 s
    InstanceLoad(files, "s", "solver", model, PLAN, STEPS, ROWS).publish({1: PLAN.prefix(300), 2: PLAN.prefix(50)})
    load = files.read()
    d = load.reports[0].demand()
    [stage] = load.stages()
    one = stage.need
    assert load.utilization() == pytest.approx(d[1] + d[2])
    assert load.wait_until(stage, target=d[1] + d[2] + one, expected_s=8.0) == 0.0
    wait = load.wait_until(stage, target=d[2] + one, expected_s=8.0)
    assert 1.0 < wait <= 3.0, "about when stream 1 ends (2 s), as stream 2's demand goes by then"
    assert load.wait_until(stage, target=0.5 * one, expected_s=8.0) == 8.0, "never enough: the longest wait"

    young = LoadBoard(tmp_path / "young")     # two STARTs a moment ago: their first chunks are the costliest
    InstanceLoad(young, "s", "solver", model, PLAN, STEPS, ROWS).publish({5: Work(), 6: Work()})
    load = young.read()
    start = load.utilization()
    steady = 2 * load.reports[0].stream_demand(PLAN.prefix(150), 1.0)   # the same two, 3 s on
    assert steady < 0.9 * start
    wait = load.wait_until(load.stages()[0], target=steady + one, expected_s=8.0)
    assert 0 < wait <= 3.0, "a third START comes in once the two have left their start, not when they end"

def test_the_calibration_calls_no_network_before_the_models_are_ready():
    """No BLS call before ``ready()`` holds (a BLS request in the window after the stub's initialize crashed
    tritonserver at load): the networks are first called after ``ready`` said yes, and the fits then start."""
    from s3flow.engine.settings import SolverSettings
    from s3flow.serving.calibration import Calibration

    events, answers = [], iter([False, False, False])

    def ready():
        ok = next(answers, True)
        events.append(("ready", ok))
        return ok

    def encode(tokens, token_len, embedding):
        events.append(("call", None))
        b, t = tokens.shape[0], 2 * tokens.shape[1]
        return torch.zeros(b, 80, t), torch.ones(b, 1, t), torch.zeros(b, 80)

    def estimate(inputs):
        events.append(("call", None))
        return torch.zeros_like(inputs.x)

    settings = SolverSettings()
    engine = StreamingEngine(encode, estimate, n_feats=80, meanflow=False, solving=settings.solving,
                             limits=settings.sequences)
    model = CapacityModel(4)
    calibration = Calibration(engine, model, settings.rules, "solver", ready=ready, log=lambda _: None,
                              retry_s=0.01).start()
    assert calibration.done.wait(60)
    first_call = events.index(("call", None))
    assert events[:first_call] == [("ready", False)] * 3 + [("ready", True)]
    assert model.estimator.calls > 0


def test_a_stopped_calibration_makes_no_call_and_its_thread_ends():
    """finalize stops the calibration while it waits for a served stream to end: no network call follows (one
    while Triton tears the instance down crashed tritonserver at its stop), and stop() returns once it ended."""
    from s3flow.engine.settings import SolverSettings
    from s3flow.serving.calibration import Calibration

    calls = []

    def encode(tokens, token_len, embedding):
        calls.append("encode")
        b, t = tokens.shape[0], 2 * tokens.shape[1]
        return torch.zeros(b, 80, t), torch.ones(b, 1, t), torch.zeros(b, 80)

    def estimate(inputs):
        calls.append("estimate")
        return torch.zeros_like(inputs.x)

    settings = SolverSettings()
    engine = StreamingEngine(encode, estimate, n_feats=80, meanflow=False, solving=settings.solving,
                             limits=settings.sequences)
    engine.sequences.begin(1, object())       # a served stream: the calibration waits for it
    calibration = Calibration(engine, CapacityModel(4), settings.rules, "solver", ready=lambda: True,
                              log=lambda _: None, retry_s=0.01).start()
    time.sleep(0.3)
    calibration.stop(timeout_s=5.0)
    assert not calibration._thread.is_alive() and calibration.done.is_set()
    engine.sequences.end(1, "cancelled")      # the stream ends after the stop: still no call
    time.sleep(0.3)
    assert calls == []


def test_chunks_given_fewer_steps_leave_the_capacity_and_the_streams_demand_at_full_steps():
    """The same chunks, once at their 10 steps and once given 6 of them (each busy stretch the priced time of what
    it did): the measured capacity is the same; only the correction sees the shorter stretches as the work they
    were. (The stream's own work, what its demand is priced from, is kept at full steps by the sequence table:
    ``test_a_stream_given_fewer_steps_is_priced_at_full_steps``.)"""
    full = Work(row_frames=2000, steps=10, chunks=1, encoder_tokens=0, frames=50)
    fewer = Work(row_frames=1200, steps=6, chunks=1, encoder_tokens=0, frames=50,
                 skipped_row_frames=800, skipped_steps=4)
    assert fewer.full() == full
    capacities = []
    for work in (full, fewer):
        model = _fitted(fixed=0.01, per_unit=1e-5)
        for _ in range(50):
            model.estimator_step(1, 2, 100)
            model.chunk_work(1, work)
            model.worked(1.3 * model._costs(1.0).seconds(work, 1))
        capacities.append(model.capacity())
        assert model.correction == pytest.approx(1.3)
    assert capacities[1] == pytest.approx(capacities[0], rel=1e-9) and capacities[0] > 0


def test_a_stream_like_the_plan_is_priced_like_the_plan_after_every_answer():
    """The default plan's chunks streamed through the engine (a 6 s prompt, capped as served; never ended): after
    each answer the stream's work equals the plan's for as much audio, so a young stream's demand is the plan's
    (a START pending and one just answered are priced alike: a burst of STARTs is judged evenly)."""
    model = CapacityModel()
    engine = stand_in_engine(model)
    for k, work in enumerate(works_after_each_chunk(engine, 5)):
        planned = PLAN.prefix(work.frames)
        assert (work.row_frames, work.steps, work.chunks) == pytest.approx(
            (planned.row_frames, planned.steps, planned.chunks)), f"after chunk {k + 1}"
