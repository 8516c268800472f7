"""What a server can carry: the cost of its work measured online, each stream's demand, the server's capacity.

Units. A stream's *demand* is device seconds per second: the share of the device's time the stream needs to
keep up with a real-time player (its work per second of audio, priced at the costs measured now). The sum over
the live streams is the server's *utilization* (1.0: the device is busy all the time); the *capacity* is how many
seconds of audio per second the device makes at full batches, for the default stream (the default chunk plan at
the default steps and guidance, a prompt of the planned length; ``s3flow.engine.planning.plan_work``).

Costs. Every estimator call and every encoder call is timed (the engine reports it to its ``Observer``) and fitted
online as ``seconds = fixed + per_unit * units`` (:class:`CostFit`: weighted least squares forgetting old calls;
units: estimator rows x padded frames, encoder tokens; an estimator call's cached keys, rows x the frames of the
prefix cache it reads, are priced apart: ``per_key``, about a tenth of a frame solved on the 2-core host). A call's
fixed part is shared by the streams batched in it, at most ``max_batch`` of them (Triton's batch, or a step's
rows): with ``n`` streams live, each pays ``fixed / min(n, max_batch)`` per call. The fits price one piece of work
against another (a young stream's chunks against an old one's, more steps, a longer prompt); they do not say what
the instance makes: the python between the calls, padding, the cores shared with other processes are nowhere in
them, and on a 2-core host their per-unit cost moved 5x between an idle server and 16 streams.

Capacity, measured from the work. The instance reports each stretch it is busy (:meth:`CapacityModel.worked`:
a FIFO execute, a step-loop iteration, a vocoder push) and the chunks it answered in it. Over a window of recent
busy time (``WINDOW_S``: half the weight in the last 20 busy seconds; an idle server keeps what it measured) it
keeps the busy time, the audio made, and the fits' price of that work at the batches it had and at full batches:

* the *correction* (busy over priced) makes the costs price what the work really takes (:meth:`costs`);
* the *capacity* (:meth:`capacity`) is the throughput (audio over busy) projected to full batches on the window's
  own work (priced at the batches it had over priced at full batches: 1 at full load), times the share of wall time
  the instance was busy while it held a full batch (the server at capacity waits on the rest of the pipeline: the
  hops, the other processes, the clients' round trips; measured when it happens, ``DUTY_PRIOR`` before).

Before any served work, the calibration at load (``s3flow.serving.calibration``) gives the fits, and the costs'
capacity for the plan is the prior. The gauge, admission's price of a stream (``s3flow.serving.load``: demands
scaled so that N default streams need N / capacity), its ``retry_after`` and the step loop's slack and fewer steps
(``s3flow.engine.step_loop``) read these same numbers.

Work. A stream's chunks report what they cost (:class:`Work`: estimator row-frames over all steps, the cached key
row-frames they read, steps, chunks, encoder tokens, frames made final); the sequence table adds them up per stream.
The server knows neither an utterance's length nor a live client's next chunks: a stream's demand is the default
plan's (:class:`Plan`) over the next ``HORIZON_S`` of its audio, scaled by how much heavier than the plan its chunks
so far have been; a START's is what the plan's ramp needs (each chunk after the first made within the start-up
buffer plus the audio before it: :meth:`Plan.start_need`, at its own steps and guidance).

Example::

    model = CapacityModel(max_batch=8)          # an engine Observer: the engine feeds it
    engine = StreamingEngine(..., observer=model)
    model.worked(execute_seconds, streams=len(table))     # after each busy stretch
    model.capacity()                                      # audio s per s at full batches, measured
    costs = model.costs()
    costs.demand(work, share=costs.share(live_streams))   # device s per s of a stream that did ``work``
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, fields
from typing import Optional

from s3flow_contract.tensors import FRAMES_PER_SECOND, TOKENS_PER_SECOND
from s3flow.engine.observer import Observer
from s3flow.protocol import NumericSettings, check_numbers

#: how much recent busy time the correction follows (half its weight is in the last this many busy seconds), and
#: how much it needs before it replaces the prior
WINDOW_S, MIN_WINDOW_S = 20.0, 0.25
#: a stretch between two reports longer than this is not the server at capacity (it idled in between); the wall
#: time at capacity a duty measurement needs
SATURATED_GAP_S, MIN_SATURATED_S = 2.0, 5.0
#: the duty before an instance has been at capacity: what the solver measured on a 2-core host serving the trained
#: small teacher, 16 streams at once (0.7: results/qos.md). A prior on the safe side for a host whose other
#: processes do not share the solver's device (a GPU): the first time at capacity measures its own
DUTY_PRIOR = 0.7
#: the weight of each estimator call in the average of streams per call
FILL_SMOOTHING = 0.05
#: how far ahead a stream's demand looks: the next seconds of its audio by the plan
HORIZON_S = 2.0
HORIZON_FRAMES = FRAMES_PER_SECOND * HORIZON_S
#: a cached key's price in a query's before the calls separate the two (``CostFit``): measured on the 2-core host
#: with the trained small teacher, 2 rows, one thread, the served read-only cached graph: 2-5 us a cached key
#: row-frame against 113 us a query row-frame in process, and its 6 KB of keys and values crossing into the
#: estimator over BLS at 1.1 ms a MB (results/bls_cost.md): 9-12 us, about a tenth of a query
KEY_PRIOR = 0.1


@dataclass
class AdmissionTarget(NumericSettings):
    """What admission holds the server's capacity to (``s3flow.serving.admission``): it refuses a START that would
    take a stage's utilization (its live streams' demand of the device) above ``utilization_target`` (0: no such
    check), and tells it to come back when enough streams of ``expected_utterance_s`` of audio have ended
    (``s3flow.serving.load``); a START is planned at that length too (``s3flow.serving.calibration``). Each is a
    ``parameters`` entry of the config of the models that read it (the solver, admission)."""
    utilization_target: float = 0.9
    expected_utterance_s: float = 5.0      # a sentence: what a START is planned at, and how long streams last

    def check(self) -> None:
        check_numbers(self, "admission setting", lowest={"utilization_target": 0})


class CostFit:
    """``seconds = fixed + per_unit * units + per_key * keys`` fitted online over the calls seen, each weighted
    down by half every ``halflife`` calls, so the fit follows the host as its load changes. Every part stays >= 0
    (a fit that would make one negative falls back to the others alone).

    ``keys`` is a second size, priced apart where the calls separate it: the estimator's cached keys (rows x the
    frames of the prefix cache a call reads, ``s3flow.model.prefix_cache``: attended to and carried in, never
    projected or convolved, issue 50), whose price is between 0 and a query's (``per_unit``: a query frame does
    all a key frame does and more). Where the calls do not separate the two (no call read a cache, or every call
    read one in the same proportion), a key costs ``key_prior`` of a query."""

    def __init__(self, halflife: float = 200.0, key_prior: float = 0.0):
        self.decay, self.key_prior = 0.5 ** (1.0 / halflife), key_prior
        #: decayed sums of 1, units, keys, seconds and their products
        self._w = self._x = self._k = self._y = self._xx = self._xk = self._kk = self._xy = self._ky = 0.0
        self.fixed = self.per_unit = self.per_key = 0.0
        self.calls = 0

    def observe(self, units: float, seconds: float, keys: float = 0.0) -> None:
        if units <= 0 or keys < 0 or not seconds >= 0 or not math.isfinite(seconds):
            return
        d = self.decay
        self._w, self._x, self._k, self._y = d * self._w + 1, d * self._x + units, d * self._k + keys, \
            d * self._y + seconds
        self._xx, self._xk, self._kk = d * self._xx + units * units, d * self._xk + units * keys, \
            d * self._kk + keys * keys
        self._xy, self._ky = d * self._xy + units * seconds, d * self._ky + keys * seconds
        self.calls += 1
        self._solve()

    def _solve(self) -> None:
        if self._kk > 0 and self._solve_apart():
            return
        # one size: units + key_prior x keys
        q = self.key_prior
        u, uu = self._x + q * self._k, self._xx + 2 * q * self._xk + q * q * self._kk
        uy = self._xy + q * self._ky
        self.fixed, self.per_unit = _line(self._w, u, self._y, uu, uy)
        self.per_key = q * self.per_unit

    def _solve_apart(self) -> bool:
        """The three parts by least squares, where the calls separate them and the key's price is within
        [0, a query's]; False otherwise."""
        a = [[self._w, self._x, self._k], [self._x, self._xx, self._xk], [self._k, self._xk, self._kk]]
        b = [self._y, self._xy, self._ky]
        det = _det3(a)
        scale = self._w * self._xx * self._kk
        if scale <= 0 or abs(det) <= 1e-6 * scale:   # keys and units move together: not separable
            return False
        parts = []
        for i in range(3):
            m = [row[:] for row in a]
            for r in range(3):
                m[r][i] = b[r]
            parts.append(_det3(m) / det)
        fixed, per_unit, per_key = parts
        if fixed < 0 or per_unit <= 0 or not 0 <= per_key <= per_unit:
            return False
        self.fixed, self.per_unit, self.per_key = fixed, per_unit, per_key
        return True

    @property
    def known(self) -> bool:
        return self.calls > 0

    def seconds(self, units: float, share: float = 1.0, keys: float = 0.0) -> float:
        """A call's seconds with its fixed part shared by ``share`` streams."""
        return self.fixed / max(share, 1.0) + self.per_unit * units + self.per_key * keys


def _line(w: float, x: float, y: float, xx: float, xy: float) -> tuple[float, float]:
    """(fixed, per_unit) of ``y = fixed + per_unit x`` from the weighted sums, both >= 0."""
    var = xx * w - x * x
    if var > 1e-9 * max(xx * w, 1e-30):   # units vary enough to separate the two parts
        b = (xy * w - x * y) / var
        a = (y - b * x) / w
        if a >= 0 and b >= 0:
            return a, b
        if b < 0:    # time does not grow with size (noise): a fixed cost alone
            return y / w, 0.0
    return 0.0, (xy / xx if xx > 0 else 0.0)   # through the origin


def _det3(m: list) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


@dataclass
class Work:
    """What chunks cost, in the units the fits price: estimator rows x padded frames summed over every step,
    estimator steps, encoder calls (one per chunk) and tokens, and the mel frames made final (the audio); the
    estimator work that chunks given fewer Euler steps than their stream's did not do (``skipped_*``: capacity
    is defined at full steps, :meth:`full`); and the cached keys their rows read beside their own frames (rows x
    the frames of the prefix cache read, over every step: a stream's kept prompt and context, issue 50)."""
    row_frames: float = 0.0
    steps: int = 0
    chunks: int = 0
    encoder_tokens: int = 0
    frames: int = 0
    skipped_row_frames: float = 0.0
    skipped_steps: int = 0
    key_row_frames: float = 0.0
    skipped_key_row_frames: float = 0.0

    def add(self, other: "Work") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def full(self) -> "Work":
        """The same chunks at their streams' full step counts."""
        return Work(self.row_frames + self.skipped_row_frames, self.steps + self.skipped_steps, self.chunks,
                    self.encoder_tokens, self.frames,
                    key_row_frames=self.key_row_frames + self.skipped_key_row_frames)

    @property
    def audio_s(self) -> float:
        return self.frames / FRAMES_PER_SECOND

    def scaled(self, nfe_ratio: float, step_ratio: float) -> "Work":
        """The same plan at other steps or guidance: estimator work x ``nfe_ratio``, steps x ``step_ratio``."""
        return Work(self.row_frames * nfe_ratio, round(self.steps * step_ratio), self.chunks, self.encoder_tokens,
                    self.frames, key_row_frames=self.key_row_frames * nfe_ratio)

    def minus(self, other: "Work") -> "Work":
        """This work less ``other``."""
        return Work(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def part(self, f: float) -> "Work":
        """``f`` of this work (whole calls and chunks rounded)."""
        return Work(self.row_frames * f, round(self.steps * f), round(self.chunks * f),
                    round(self.encoder_tokens * f), round(self.frames * f), key_row_frames=self.key_row_frames * f)


@dataclass(frozen=True)
class Costs:
    """A snapshot of the fits: seconds per estimator call (``est_fixed`` + ``est_per_unit`` per row-frame solved +
    ``est_per_key`` per cached key row-frame read) and per encoder call (``enc_fixed`` + ``enc_per_unit`` per
    token); a call's fixed part is shared by the streams batched in it, at most ``max_batch``."""
    est_fixed: float = 0.0
    est_per_unit: float = 0.0
    enc_fixed: float = 0.0
    enc_per_unit: float = 0.0
    max_batch: int = 1
    est_per_key: float = 0.0

    @property
    def known(self) -> bool:
        return self.est_fixed > 0 or self.est_per_unit > 0

    def step_seconds(self, rows: int, frames: int, past: int = 0) -> float:
        """One estimator call of ``rows`` rows over ``frames`` padded frames, each reading ``past`` cached frames
        (padded; the step loop's step cost)."""
        return self.est_fixed + rows * (self.est_per_unit * frames + self.est_per_key * past)

    def encoder_seconds(self, tokens: int) -> float:
        """One encoder call over ``tokens`` tokens."""
        return self.enc_fixed + self.enc_per_unit * tokens

    def scaled(self, k: float) -> "Costs":
        """Every part ``k`` times (a host ``k`` times slower)."""
        return Costs(k * self.est_fixed, k * self.est_per_unit, k * self.enc_fixed, k * self.enc_per_unit,
                     self.max_batch, k * self.est_per_key)

    def share(self, streams: int) -> float:
        return float(min(max(streams, 1), self.max_batch))

    def seconds(self, work: Work, share: float) -> float:
        """Device seconds ``work`` takes, each call's fixed part shared by ``share`` streams."""
        share = max(share, 1.0)
        return (work.row_frames * self.est_per_unit + work.key_row_frames * self.est_per_key
                + work.steps * self.est_fixed / share
                + work.encoder_tokens * self.enc_per_unit + work.chunks * self.enc_fixed / share)

    def demand(self, work: Work, share: float) -> float:
        """Device seconds per second of audio (0 for work that made no audio yet)."""
        return self.seconds(work, share) / work.audio_s if work.frames else 0.0

    def capacity(self, planned: Work) -> float:
        """Audio seconds per second the device makes for streams like ``planned`` when it is busy all the time:
        N streams such that N x demand(N) = 1 (their calls' fixed parts shared by min(N, max_batch))."""
        if not planned.frames or not self.known:
            return 0.0
        per_s = 1.0 / planned.audio_s
        variable = self.seconds(Work(planned.row_frames, 0, 0, planned.encoder_tokens, planned.frames,
                                     key_row_frames=planned.key_row_frames), 1) * per_s
        fixed = self.seconds(Work(0.0, planned.steps, planned.chunks, 0, planned.frames), 1) * per_s
        full = variable + fixed / self.max_batch
        if full <= 0:
            return 0.0
        if 1.0 / full >= self.max_batch:
            return 1.0 / full
        return max(0.0, (1.0 - fixed) / variable) if variable > 0 else float(self.max_batch)  # below a full batch


class CapacityModel(Observer):
    """The instance's cost fits (every estimator and encoder call the engine reports), the correction that makes
    them price what the instance really takes, and its capacity (module docstring); each stream's own work is the
    sequence table's (``s3flow.engine.sequences.SequenceTable.works``). Thread-safe (the stepped path reports
    from its step thread)."""

    def __init__(self, max_batch: int = 8, halflife: float = 200.0, prior_correction: float = 1.0,
                 window_s: float = WINDOW_S, clock=time.monotonic, duty_prior: Optional[float] = DUTY_PRIOR):
        """``duty_prior`` None: the instance's idle share at capacity is not its own (the vocoder waits for the
        solver, the bottleneck): its capacity is its throughput alone."""
        self.max_batch = max(1, int(max_batch))
        self.estimator, self.encoder = CostFit(halflife, key_prior=KEY_PRIOR), CostFit(halflife)
        #: busy time over what the fits price the work made in it at, over the last ``window_s`` of busy time;
        #: ``prior_correction`` until there is such work
        self.prior_correction, self.window_s = prior_correction, window_s
        self._busy = self._priced = self._full = self._audio = 0.0   # the window: decayed sums
        #: the same over the stretches when the instance held a full batch of streams, with their wall time
        self._sat_wall = self._sat_busy = self._sat_priced = self._sat_full = self._sat_audio = 0.0
        self.clock, self._last, self.duty_prior = clock, None, duty_prior
        self._made = Work()                                 # answered since the last ``worked``
        #: the capacity before the window holds work, and whether the priors came from served work (``restore``)
        self.prior_capacity: Optional[float] = None
        self._served_prior = False
        self._fill = 1.0                                    # streams per estimator call, averaged over recent calls
        self._lock = threading.Lock()

    # -- the engine's reports ----------------------------------------------------------------------------
    def estimator_step(self, sequences: int, rows: int, frames: int) -> None:
        with self._lock:
            self._fill += FILL_SMOOTHING * (max(sequences, 1) - self._fill)

    def estimator_timed(self, rows: int, frames: int, seconds: float, past: int = 0) -> None:
        with self._lock:
            self.estimator.observe(rows * frames, seconds, keys=rows * past)

    def encoder_timed(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.encoder.observe(tokens, seconds)

    def chunk_work(self, corr_id, work: Work) -> None:
        """A chunk answered: the window counts what it did (its stream's work is the sequence table's)."""
        with self._lock:
            self._made.add(work)

    def worked(self, seconds: float, streams: int = 0) -> None:
        """The instance was busy ``seconds`` (an execute, a step-loop iteration, a vocoder push) holding
        ``streams`` streams, and made the chunks answered since the last call: both join the window (module
        docstring), older work weighing less."""
        if not seconds > 0 or not math.isfinite(seconds):
            return
        with self._lock:
            now = self.clock()
            wall = max(now - self._last, seconds) if self._last is not None else seconds
            self._last = now
            made, self._made = self._made, Work()
            decay = 0.5 ** (seconds / self.window_s)
            fits = self._costs(1.0)
            priced = fits.seconds(made, self._share()) if fits.known else 0.0
            full = fits.seconds(made, self.max_batch) if fits.known else 0.0
            # audio made at fewer steps counts for the share of its full-step work it took: capacity stays
            # defined at full steps (fewer steps never make admission take more)
            at_full_steps = fits.seconds(made.full(), self._share()) if fits.known and made.skipped_steps else 0.0
            audio = made.audio_s * (priced / at_full_steps if at_full_steps > 0 else 1.0)
            self._busy = decay * self._busy + seconds
            self._priced = decay * self._priced + priced
            self._full = decay * self._full + full
            self._audio = decay * self._audio + audio
            if streams >= self.max_batch and wall < SATURATED_GAP_S:   # a full batch held: the server at capacity
                d = 0.5 ** (wall / self.window_s)
                self._sat_wall, self._sat_busy = d * self._sat_wall + wall, d * self._sat_busy + seconds
                self._sat_priced, self._sat_full = d * self._sat_priced + priced, d * self._sat_full + full
                self._sat_audio = d * self._sat_audio + audio

    def calibrated(self, busy_s: float, made: Work, streams: int) -> None:
        """The calibration at load (``s3flow.serving.warmup.calibrate_solver``) kept its instance busy ``busy_s``
        making ``made`` with ``streams`` streams in each call: busy over what the fits price it at is the correction
        until served work measures its own (the prior capacity then holds the time between the calls too), unless
        a price saved from served work (:meth:`restore`) gave a better one."""
        with self._lock:
            fits = self._costs(1.0)
            priced = fits.seconds(made, streams) if fits.known else 0.0
            if priced > 0 and busy_s > 0 and not self._served_prior:
                self.prior_correction = busy_s / priced

    def state(self) -> dict:
        """What it has measured, to start the next instance from (``restore``; ``s3flow.serving.saved_price``): the
        fits, the correction, the busy share at capacity and the capacity, and whether served work measured them."""
        with self._lock:
            measured = self._capacity()
            served = measured is not None
            return {"estimator": [self.estimator.fixed, self.estimator.per_unit, self.estimator.per_key],
                    "encoder": [self.encoder.fixed, self.encoder.per_unit],
                    "correction": self._correction() if served else self.prior_correction,
                    "duty": self._duty(), "served": served or self._served_prior,
                    "capacity": measured if served else self.prior_capacity}

    def restore(self, state: dict) -> None:
        """Start from a ``state`` an earlier instance measured: its fits (until calls are timed here), correction,
        busy share at capacity and capacity are the priors (each replaced as this instance measures its own)."""
        with self._lock:
            for fit, parts in ((self.estimator, state["estimator"]), (self.encoder, state["encoder"])):
                fixed, per_unit, *key = parts   # (a price saved before keys were priced has two parts)
                if fit.calls == 0 and (fixed > 0 or per_unit > 0):
                    fit.fixed, fit.per_unit, fit.calls = float(fixed), float(per_unit), 1
                    fit.per_key = float(key[0]) if key else fit.key_prior * fit.per_unit
            self.prior_correction = float(state["correction"])
            if self.duty_prior is not None:
                self.duty_prior = float(state["duty"])
            self.prior_capacity = float(state["capacity"]) if state.get("capacity") else None
            self._served_prior = bool(state.get("served"))

    def start_from(self, costs: Costs) -> None:
        """Start from a price known beforehand (``restore`` of it as served work's, correction 1): what the
        simulator's instances begin with (``s3flow_tools.sim.virtual_server``)."""
        self.restore({"estimator": [costs.est_fixed, costs.est_per_unit, costs.est_per_key],
                      "encoder": [costs.enc_fixed, costs.enc_per_unit], "correction": 1.0,
                      "duty": self.duty_prior, "served": True, "capacity": None})

    @property
    def correction(self) -> Optional[float]:
        """Busy time over priced work in the window; None before there is any."""
        with self._lock:
            return self._correction()

    @property
    def throughput(self) -> float:
        """Audio seconds made per second of busy time in the window (at the batches the load had); 0 before."""
        with self._lock:
            return self._audio / self._busy if self._busy > 0 else 0.0

    def capacity(self) -> Optional[float]:
        """Audio seconds per second the instance makes at full batches: the window's throughput, its work priced at
        full batches against at the batches it had (the projection: a call's fixed part shared by ``max_batch``
        streams; 1 at full load), times the share of wall time it was busy while it held a full batch (the server
        at capacity: the rest of the pipeline, the hops, the other processes on the device, the clients' round
        trips, leave it idle part of the time; ``duty_prior`` before it has been at capacity). None before the
        window holds work."""
        with self._lock:
            return self._capacity()

    def _capacity(self) -> Optional[float]:
        if self._correction() is None or self._audio <= 0 or self._full <= 0:
            return None
        return self._audio / self._busy * self._priced / self._full * self._duty()

    @property
    def duty(self) -> float:
        """Busy over wall time while at capacity (or the prior; 1 for an instance that does not measure it)."""
        with self._lock:
            return self._duty()

    def _duty(self) -> float:
        """Busy over wall time while at capacity, its work projected to full batches (module docstring); the prior
        ``duty_prior`` before the instance has been at capacity."""
        if self.duty_prior is None:
            return 1.0
        if self._sat_wall < MIN_SATURATED_S or self._sat_full <= 0 or self._sat_priced <= 0:
            return self.duty_prior
        return min(1.0, self._sat_busy / self._sat_wall * self._sat_full / self._sat_priced)

    def costs(self) -> Costs:
        """The fits times the correction: what the work costs the instance."""
        with self._lock:
            k = self._correction()
            return self._costs(self.prior_correction if k is None else k)

    def _share(self) -> float:
        return min(max(self._fill, 1.0), float(self.max_batch))

    def _correction(self) -> Optional[float]:
        if self._priced <= 0 or self._busy < MIN_WINDOW_S:
            return None
        return self._busy / self._priced

    def _costs(self, k: float) -> Costs:
        e, n = self.estimator, self.encoder
        return Costs(k * e.fixed, k * e.per_unit, k * n.fixed, k * n.per_unit, self.max_batch, k * e.per_key)


@dataclass
class Plan:
    """The work of a default utterance chunk by chunk (``chunks``: each chunk's ``Work``), and the length it is
    expected to have (``expected_frames``). A stream is priced against it: its work so far over the plan's for as
    much audio (:meth:`prefix`) says how much heavier than the default it is (more steps, a longer prompt), and its
    demand is the plan's over the expected length times that ratio; so a stream's early chunks (the costliest per
    second of audio: the first is small and carries the whole prompt) do not count as its rate for good. A START is
    priced by what its ramp needs (:meth:`start_need`), ``start_buffer_s`` the audio its player holds first."""
    chunks: list
    expected_frames: int
    start_buffer_s: float = 0.3

    def prefix(self, frames: float) -> Work:
        """The plan's work for its first ``frames`` generated frames (within a chunk: in proportion; beyond the
        plan: more of its last chunk)."""
        out, made = Work(), 0
        for w in self.chunks:
            if made + w.frames <= frames:
                out.add(w)
                made += w.frames
                continue
            out.add(w.part((frames - made) / w.frames))
            return out
        last = self.chunks[-1]
        while frames - made >= last.frames:   # past the plan: its last chunk size again and again
            out.add(last)
            made += last.frames
        if frames > made:
            out.add(last.part((frames - made) / last.frames))
        return out

    def expected(self) -> Work:
        return self.prefix(self.expected_frames)

    def window(self, start: float, frames: float = HORIZON_FRAMES) -> Work:
        """The plan's work for its generated frames [start, start + frames)."""
        return self.prefix(start + frames).minus(self.prefix(start))

    def start_need(self, costs: "Costs", share: float, nfe_ratio: float = 1.0, step_ratio: float = 1.0) -> float:
        """A START's demand (device s per s of wall time): the first chunk is its first audio's wait; then each
        chunk must be made within the start-up buffer plus the audio of the chunks before it, and each holds
        twice the audio of the one before (the client's schedule), so while it ramps up a stream needs its frames
        faster than it plays them: the most that any chunk up to the expected length asks of the device, counting
        every chunk since the first (results/at_once.md: streams started together share the device and run dry
        past about 0.6 C; priced by their first two seconds alone, floor(0.8 C) were admitted at once and some ran
        dry). ``nfe_ratio``, ``step_ratio``: the START's own steps and guidance against the plan's. At least the
        plan's first ``HORIZON_S`` per second of audio."""
        floor = costs.demand(self.window(0).scaled(nfe_ratio, step_ratio), share)
        need, cost, audio = 0.0, 0.0, self.chunks[0].frames
        for w in self.chunks[1:]:
            if audio >= max(self.expected_frames, HORIZON_FRAMES):
                break
            cost += costs.seconds(w.scaled(nfe_ratio, step_ratio), share)
            need = max(need, cost / (self.start_buffer_s + audio / FRAMES_PER_SECOND))
            audio += w.frames
        return max(need, floor)

    def demand(self, costs: "Costs", work: Work, share: float) -> float:
        """A stream's demand (device s per s) that did ``work`` so far: the plan's over the next ``HORIZON_S`` of
        its audio (a young stream's chunks are the costliest per second of audio, and a real-time player needs
        each of them in time, not on average), scaled by how much more its work cost than the plan's for as much
        audio; a START's: :meth:`start_need`."""
        if not work.frames:
            return self.start_need(costs, share)
        planned = costs.demand(self.window(work.frames), share)
        base = costs.seconds(self.prefix(work.frames), share)
        return planned * costs.seconds(work, share) / base if base > 0 else planned


def default_plan(expected_s: float) -> list[int]:
    """The chunk sizes a client sends by default for an utterance of ``expected_s`` seconds (25 tokens a second):
    the client's own ``chunk_schedule`` (a package the server depends on)."""
    from s3flow_client.chunking import chunk_schedule
    return chunk_schedule(max(1, round(TOKENS_PER_SECOND * expected_s)))
