"""The server on a virtual clock (``s3flow_tools.sim``): the solver's own code over priced stand-in networks, its
clients, and the price it reads from a served repository. Triton-free and deterministic (a cost model, no clock);
how near it comes to a real server is measured by ``python -m s3flow_tools.measure.qos`` (results/qos.md)."""
from __future__ import annotations

import dataclasses

import pytest

from s3flow.engine.capacity import CapacityModel, Costs
from s3flow.engine.planning import planned_calls
from s3flow.engine.settings import SolverSettings
from s3flow.repository.settings import Batching, RepositorySettings
from s3flow_client.chunking import chunk_schedule
from s3flow_client.demo import demo_utterance
from s3flow_tools.sim.price import chunk_work, fit_alone, served_costs
from s3flow_tools.sim.streams import run_streams
from s3flow_tools.sim.virtual_server import HostCosts, Pricing, VirtualServer

COSTS = Costs(est_fixed=2e-3, est_per_unit=1e-6, enc_fixed=1e-3, enc_per_unit=1e-5, max_batch=8)


def settings(scheduling: str = "fifo", instances: int = 1, **solving) -> RepositorySettings:
    solver = SolverSettings().replace(**solving) if solving else SolverSettings()
    return RepositorySettings(solver=solver, scheduling=scheduling,
                              batching=Batching(solver_instances=instances, estimator_instances=instances))


def utterances(n: int, seconds: float = 3.0) -> list:
    return [dataclasses.replace(demo_utterance(seconds, seed=k, prompt_seconds=2.0), seed=k) for k in range(n)]


def test_one_stream_takes_what_its_planned_calls_cost_plus_its_transit():
    """A stream alone: its first answer comes after Triton's queue delay (an execute waits that long for a fuller
    batch), its first chunk's encoder call and its 10 Euler steps, each priced by the costs, plus the transit; the
    steps are the engine's own plan (``planned_calls``)."""
    u = utterances(1)[0]
    sizes = chunk_schedule(len(u.speech_tokens))
    s = settings()
    calls = planned_calls(80, prompt_tokens=len(u.prompt_tokens), chunks=sizes, context_frames=100, steps=10,
                          prompt_frames=s.solver.solving.prompt_frames)
    first = sum(COSTS.step_seconds(r, f) for r, f in calls[:10])
    prompt = min(len(u.prompt_tokens), s.solver.solving.prompt_frames // 2)
    encoder = COSTS.encoder_seconds(prompt + sizes[0])
    [r] = run_streams(VirtualServer(s, COSTS, HostCosts(transit_s=0.01), n_feats=80), [u], [0.0],
                      rules=s.solver.rules)
    delay = s.batching.max_queue_delay_us * 1e-6
    assert r.error is None and r.first_chunk_s == pytest.approx(delay + first + encoder + 0.01, rel=1e-9)
    assert r.mel.shape[1] == r.frames_expected, "every frame answered"


@pytest.mark.parametrize("scheduling,keep_solved", [("fifo", 0), ("deadline", 0), ("fifo", 2)])
def test_every_stream_gets_every_frame_in_order(scheduling, keep_solved):
    s = settings(scheduling, instances=2, keep_solved=keep_solved)
    results = run_streams(VirtualServer(s, COSTS, n_feats=80), utterances(6), [0.1 * k for k in range(6)],
                          rules=s.solver.rules)
    for r in results:
        assert r.error is None and r.mel.shape[1] == r.frames_expected
        assert len(r.chunk_frames) == len(r.chunk_latencies_s) and min(r.chunk_latencies_s) > 0


def test_fifo_answers_a_batch_together_and_keeping_what_is_solved_makes_streams_cheaper():
    """Streams started together on one instance are one batch (answered at once); with keep_solved 2 the same
    load ends sooner when frames are what costs (every frame solved once: results/stream_reuse.md)."""
    us, frames_only = utterances(4), Costs(est_per_unit=1e-6)
    plain = run_streams(VirtualServer(settings(), frames_only, n_feats=80), us, [0.0] * 4)
    assert len({round(r.first_chunk_s, 12) for r in plain}) == 1, "one execute answers the four STARTs"
    kept = run_streams(VirtualServer(settings(keep_solved=2), frames_only, n_feats=80), us, [0.0] * 4)
    assert max(r.wall_s for r in kept) < 0.75 * max(r.wall_s for r in plain)


def test_fifo_batches_only_requests_carrying_the_same_inputs_as_the_oldest():
    """Triton lets a request join a batch of a model with optional inputs only with the same input names as the
    batch's oldest, and the first that differs closes the batch (``RequiredEqualInputs``): a START (with its prompt)
    and another stream's later chunk waiting together go in two executes, two STARTs in one. Offered without their
    input names, any two are batched (as the simulator did before, 0.9-1.2 s too early at 1 C over 2 s)."""
    from s3flow.protocol import parse_request

    one, two, three = utterances(3)
    s = settings()

    def request(u, lo, hi, start):
        arrays = u.request(lo, hi, start=start)
        return parse_request(arrays, start=start, end=False, rules=s.solver.rules, n_feats=80), frozenset(arrays)

    def answered(server):
        out = {}
        while server.next_time() is not None:
            for t, corr_id, outcome in server.step():
                assert not isinstance(outcome, Exception), outcome
                out.setdefault(corr_id, []).append(t)
        return out

    for named, executes in ((True, 2), (False, 1)):
        server = VirtualServer(s, COSTS, n_feats=80)
        req, names = request(one, 0, 10, True)
        server.offer(0.0, 1, req, names if named else None)
        answered(server)
        for corr_id, (req, names) in ((2, request(two, 0, 10, True)), (1, request(one, 10, 30, False))):
            server.offer(1.0, corr_id, req, names if named else None)
        times = answered(server)
        assert len({times[2][0], times[1][0]}) == executes, (named, times)
        if named:
            assert times[2][0] < times[1][0], "the START, oldest, goes first: the later chunk waits for the next"
    server = VirtualServer(s, COSTS, n_feats=80)
    for corr_id, u in ((1, two), (2, three)):
        req, names = request(u, 0, 10, True)
        server.offer(0.0, corr_id, req, names)
    times = answered(server)
    assert times[1] == times[2], "two STARTs carry the same inputs: one execute"


def test_starts_go_to_the_instance_holding_fewest():
    s = settings(instances=2)
    server = VirtualServer(s, COSTS, n_feats=80)
    run_streams(server, utterances(4), [0.0, 0.0, 0.0, 0.0])
    assert [len(i.engine.sequences) for i in server.instances] == [0, 0], "every stream ended"
    assert sorted(i.engine.estimator_calls > 0 for i in server.instances) == [True, True], "both worked"


def test_one_stream_alone_is_served_alike_by_both_schedulings():
    us = utterances(1)
    out = {}
    for scheduling in ("fifo", "deadline"):
        s = settings(scheduling)
        [r] = run_streams(VirtualServer(s, COSTS, n_feats=80), us, [0.0], rules=s.solver.rules)
        out[scheduling] = r
    assert out["fifo"].chunk_frames == out["deadline"].chunk_frames
    delay = settings().batching.max_queue_delay_us * 1e-6    # an execute waits that long for a fuller batch
    fifo, deadline = out["fifo"], out["deadline"]
    assert fifo.wall_s == pytest.approx(deadline.wall_s + delay * len(fifo.chunk_frames), rel=1e-9)
    assert out["fifo"].playback_stalls(0.3)[0] == out["deadline"].playback_stalls(0.3)[0] == 0


def test_near_saturation_least_slack_keeps_players_fed_where_fifo_lets_some_run_dry():
    """The deadline loop steps first the chunks whose players run dry soonest, where FIFO solves whole batches in
    arrival order: on a load FIFO just cannot carry (12 streams 50 ms apart at 6x the costs), some of FIFO's
    players run dry (0.3 s buffer) and fewer of least slack's do."""
    us, at = utterances(12, seconds=4.0), [0.05 * k for k in range(12)]
    dry = {}
    for scheduling in ("fifo", "deadline"):
        s = settings(scheduling, min_steps=0)
        results = run_streams(VirtualServer(s, COSTS.scaled(6.0), n_feats=80), us, at, rules=s.solver.rules)
        dry[scheduling] = sum(r.playback_stalls(0.3)[0] > 0 for r in results)
    assert dry["fifo"] > 0 and dry["deadline"] < dry["fifo"]


def test_the_simulator_counts_the_chunks_its_loops_give_fewer_steps():
    """What the server counts in ``s3flow_fewer_steps_chunks_total``, the simulator counts too: none at full steps
    (``min_steps`` 0) or under FIFO; some, and no more than the chunks answered, where late chunks may be given
    fewer (twice the overload above: at 6x the costs least slack needs none)."""
    us, at = utterances(12, seconds=4.0), [0.05 * k for k in range(12)]
    counted = {}
    for scheduling, min_steps in (("fifo", 4), ("deadline", 0), ("deadline", 4)):
        s = settings(scheduling, min_steps=min_steps)
        server = VirtualServer(s, COSTS.scaled(12.0), n_feats=80)
        results = run_streams(server, us, at, rules=s.solver.rules)
        counted[(scheduling, min_steps)] = (server.fewer_steps_chunks, sum(len(r.chunk_frames) for r in results))
    assert counted[("fifo", 4)][0] == counted[("deadline", 0)][0] == 0
    fewer, chunks = counted[("deadline", 4)]
    assert 0 < fewer <= chunks, counted


def test_the_step_loop_decides_by_what_its_instance_measures_not_by_the_price_it_started_from():
    """As the server's loop decides by its instance's ``CapacityModel`` (restored from the last server's price,
    then moved by every timed call), so does the simulator's: started from a price twelve times too low, its
    instance measures the calls' real prices on the virtual clock and gives late chunks fewer steps as one started
    from the right price does, where deciding by the price it started from would never judge a chunk late."""
    us, at = utterances(12, seconds=4.0), [0.05 * k for k in range(12)]
    s = settings("deadline", min_steps=4)
    dear = COSTS.scaled(12.0)
    fewer = {}
    for start in ("right", "low"):
        server = VirtualServer(s, dear if start == "right" else COSTS, n_feats=80, pricing=Pricing.of(dear))
        run_streams(server, us, at, rules=s.solver.rules)
        fewer[start] = server.fewer_steps_chunks
        measured = server.instances[0].capacity.costs()
        assert measured.est_per_unit == pytest.approx(dear.est_per_unit, rel=0.05), (start, measured)
        assert measured.est_fixed == pytest.approx(dear.est_fixed, rel=0.05), (start, measured)
    # (only the decisions before its first call is timed are by the price it started from)
    assert fewer["right"] > 0 and abs(fewer["low"] - fewer["right"]) <= 2, fewer


@pytest.mark.parametrize("scheduling", ["fifo", "deadline"])
def test_an_instance_measures_the_hosts_python_beside_its_calls_as_the_servers_does(scheduling):
    """The server's instance reports its whole execute (or iteration) as worked, its Python between the calls
    included, so its correction (busy over what the fits price) holds the host's time: so does the simulator's. With
    no host time the correction is 1; with the host's Python per step about the calls' own time it is about 2."""
    us = utterances(4)
    corrections = {}
    for step_s in (0.0, 2.5e-3):
        s = settings(scheduling)   # (one instance, busy beyond the least the correction is measured over, 0.25 s)
        server = VirtualServer(s, COSTS, HostCosts(step_s=step_s), n_feats=80)
        run_streams(server, us, [0.0, 0.5, 1.0, 1.5], rules=s.solver.rules)
        [k] = {i.capacity.correction for i in server.instances}
        corrections[step_s] = k
    assert corrections[0.0] == pytest.approx(1.0, rel=0.02), corrections
    assert 1.6 < corrections[2.5e-3] < 2.6, corrections


def test_a_slot_frees_when_its_end_is_answered_not_when_it_is_taken():
    """Triton frees a sequence's slot when its END is answered: a START arriving while another stream's END is
    still being solved goes to the other (idle) instance, and is answered as soon as a stream alone."""
    one, two = utterances(2)
    one = dataclasses.replace(one, chunks=[len(one.speech_tokens)])   # START and END in one long request
    s, costs = settings(instances=2), COSTS.scaled(5.0)
    [alone] = run_streams(VirtualServer(s, costs, n_feats=80), [two], [0.0])
    results = run_streams(VirtualServer(s, costs, n_feats=80), [one, two], [0.0, 0.01])
    assert results[0].first_chunk_s > 0.05, "the first stream's one request is still being solved at 0.01 s"
    assert results[1].first_chunk_s == pytest.approx(alone.first_chunk_s, rel=1e-9)


def test_served_costs_are_the_saved_fits_times_their_correction(tmp_path):
    from s3flow.serving.saved_price import SavedPrice

    folder = tmp_path / "cfm_solver"
    for k, correction in enumerate((1.5, 2.5)):
        model = CapacityModel(max_batch=8)
        model.restore({"estimator": [1e-3, 2e-7], "encoder": [5e-4, 1e-5], "correction": correction, "duty": 0.9,
                       "served": True, "capacity": 3.0})
        SavedPrice.beside(folder, f"cfm_solver_0_{k}").save(model.state())
    costs = served_costs(tmp_path)
    assert (costs.est_fixed, costs.est_per_unit, costs.enc_fixed) == pytest.approx((2e-3, 4e-7, 1e-3))
    with pytest.raises(ValueError, match="no saved price"):
        served_costs(tmp_path / "elsewhere")


def test_an_instance_working_beside_another_is_priced_at_load():
    """Two STARTs at once on two instances: the one that begins first works alone (priced alone), the other
    begins while it works (priced at load, here twice as dear)."""
    us, s = utterances(2), settings(instances=2)
    server = VirtualServer(s, COSTS, n_feats=80, loaded=Pricing.of(COSTS.scaled(2.0)))
    firsts = sorted(r.first_chunk_s for r in run_streams(server, us, [0.0, 0.0], rules=s.solver.rules))
    delay = s.batching.max_queue_delay_us * 1e-6
    assert firsts[1] - delay == pytest.approx(2 * (firsts[0] - delay), rel=1e-9)


def test_the_alone_fit_recovers_the_costs_a_stream_alone_was_timed_at():
    """``fit_alone`` from a stream alone's chunk latencies: latencies made by known costs give those costs back
    (a cached key row-frame at the saved price's ratio to a row-frame: a tenth here)."""
    u, s = utterances(1)[0], settings(keep_solved=1)
    true = Costs(est_fixed=3e-3, est_per_unit=5e-5, enc_fixed=COSTS.enc_fixed, enc_per_unit=COSTS.enc_per_unit,
                 est_per_key=5e-6)
    [r] = run_streams(VirtualServer(s, true, HostCosts(transit_s=0.002), n_feats=80), [u], [0.0])
    points = list(zip(chunk_work(s, u), r.chunk_latencies_s))
    assert [calls for (_, calls, _, _), _ in points] == [10] * len(points), "each chunk's 10 Euler steps, counted once"
    assert all(keys > 0 for (_, _, _, keys), _ in points[1:]), "the chunks after the first read the kept prompt"
    saved = dataclasses.replace(COSTS, est_per_key=0.1 * COSTS.est_per_unit)
    fit = fit_alone(points, saved, s.batching.max_queue_delay_us * 1e-6, 0.002)
    assert (fit.est_fixed, fit.est_per_unit, fit.est_per_key) == pytest.approx((3e-3, 5e-5, 5e-6), rel=1e-6)


def test_the_simulator_refuses_unknown_costs():
    with pytest.raises(ValueError, match="known costs"):
        VirtualServer(settings(), Costs(), n_feats=80)


def test_a_stream_by_a_held_voice_is_priced_as_its_plan_without_the_prompt():
    """An utterance naming a voice starts by it: the voice's first stream pays its prompt pass (10 steps of the
    capped prompt alone), the next one's first answer is exactly the plan of a stream whose prompt's cache is held
    (``planned_calls(by_voice=True)``), sooner than the same stream by prompt."""
    u = dataclasses.replace(utterances(1)[0], voice_id="v-1")
    sizes = chunk_schedule(len(u.speech_tokens))
    s = settings(keep_solved=1, context_frames=25, voice_cache_mb=16)
    held = planned_calls(80, prompt_tokens=len(u.prompt_tokens), chunks=sizes, context_frames=25, steps=10,
                         prompt_frames=50, keep_solved=1, by_voice=True)
    first = sum(COSTS.step_seconds(r, f) for r, f in held[:10])
    encoder = COSTS.encoder_seconds(25 + sizes[0])
    delay = s.batching.max_queue_delay_us * 1e-6
    server = VirtualServer(s, COSTS, HostCosts(transit_s=0.01), n_feats=80)
    [made] = run_streams(server, [u], [0.0], rules=s.solver.rules)
    [again] = run_streams(server, [u], [made.wall_s + 1.0], rules=s.solver.rules)
    pass_s = sum(COSTS.step_seconds(2, 50) for _ in range(10)) + COSTS.encoder_seconds(25)
    assert again.first_chunk_s == pytest.approx(delay + first + encoder + 0.01, rel=1e-9)
    assert made.first_chunk_s == pytest.approx(again.first_chunk_s + pass_s, rel=1e-9)
    [by_prompt] = run_streams(VirtualServer(s, COSTS, HostCosts(transit_s=0.01), n_feats=80),
                              [dataclasses.replace(u, voice_id=None)], [0.0], rules=s.solver.rules)
    assert again.first_chunk_s < by_prompt.first_chunk_s
    assert again.mel.shape[1] == again.frames_expected


def test_the_qos_check_judges_a_cell_by_its_runs_median_and_shows_the_servers_own_spread():
    """results/qos.md's cell-by-cell check: a cell of 4 or more streams is within when the simulator's p95 is within
    25 % of the median of the server's runs and its streams that ran dry within one; each run's p95 is shown with
    the farthest from the median; the order against FIFO is judged only in cells of 4 or more streams where every
    run of one mode is below every run of the other, and counted right only where the simulator orders them so."""
    from s3flow_tools.measure.qos import _simulator_check

    def run(label, mode, n, first_s, sim_s, dry=0, sim_dry=0):
        return {"label": label, "mode": mode, "n": n, "first": [first_s] * n, "dry": dry,
                "sim": ([sim_s] * n, sim_dry, 0)}

    rows = [run("steady", "fifo", 6, x, 0.50) for x in (0.40, 0.50, 0.60)]           # sim at the median
    rows += [run("steady", "fewer", 6, x, 0.30) for x in (0.30, 0.31, 0.32)]          # below FIFO's runs: right
    rows += [run("slow", "fifo", 4, x, 0.50) for x in (0.30, 0.31, 0.32)]
    rows += [run("slow", "fewer", 4, x, 0.31, dry=1, sim_dry=3) for x in (0.40, 0.41, 0.42)]   # above: sim wrong
    rows += [run("wild", "fifo", 8, x, 0.30) for x in (0.30, 0.50, 1.00)]             # -40 %, runs +-100 %
    rows += [run("wild", "fewer", 8, x, 0.90) for x in (0.40, 0.60, 0.70)]            # overlaps FIFO's runs
    rows += [run("alone", "fifo", 1, x, 0.90) for x in (0.15, 0.16)]                  # one stream: not judged
    rows += [run("alone", "fewer", 1, x, 0.10) for x in (0.20, 0.21)]                 # (apart, but one stream)
    text = "\n".join(_simulator_check(rows, ["fifo", "fewer"]))
    assert "| steady | fifo | 6 | 500 / 500 | +0 % | 400 500 600 (±20 %) | 0 / 0 | yes |" in text
    assert "| steady | fewer | 6 | 310 / 300 | -3 % | 300 310 320 (±3 %) | 0 / 0 | yes |" in text
    assert "| slow | fewer | 4 | 410 / 310 | -24 % | 400 410 420 (±2 %) | 1 / 3 | no |" in text, "2 streams off"
    assert "| wild | fifo | 8 | 500 / 300 | -40 % | 300 500 1000 (±100 %) | 0 / 0 | no |" in text
    assert "| alone | fifo | 1 |" in text and text.count("| - |") == 2
    assert ("Within the target: 2 of 6 cells of 4 or more streams. The server's own runs spread wider than 25 % from "
            "their median in 2 of them; of those, the simulator's error is within that spread in 1.") in text
    assert ("as the server's: 1 of the 2 cells of 4 or more streams where every run of one is below every run of the "
            "other (1 of 3 overlap)") in text
