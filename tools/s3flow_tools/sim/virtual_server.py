"""The solver's own code on a virtual clock: ``cfm_solver`` instances as the repository builds them, over networks
whose calls take the time the server's own cost model says (issue 51).

Each solver instance is the server's ``StreamingEngine`` and ``StepLoop`` (the same planning, conditioning, keep-
solved caches, policy and fewer-steps code), run over stand-in networks that return zeros and charge a call's
seconds to the instance (``Pricing``): by default ``Costs.step_seconds(rows, frames, past)`` per estimator call and
``Costs.encoder_seconds(tokens)`` per encoder call, the costs the server itself prices admission with
(``s3flow.engine.capacity``: the fits times its correction, read from the price a served instance saved,
``s3flow_tools.sim.price``); a projection prices calls by FLOPs instead, and may add the vocoder's time for the
answers on the same device. ``HostCosts`` adds the solver's Python per chunk and per step beyond what the prices
hold, and a request's way in and its answer's way out (client, gRPC, the ensemble), which takes time but no
solver.

What Triton does around the solver is modelled as it is configured (``RepositorySettings``):

* a START goes to the instance holding the fewest sequences (Triton's sequence batcher hands a new sequence the
  lowest free slot over its instances); a sequence stays on its instance, and its slot frees when its END is
  answered (the end of that execute), not when the END is taken;
* ``fifo``: a free instance takes up to ``max_batch_size`` waiting chunks of its sequences, oldest first, one per
  sequence, after ``max_queue_delay`` unless the batch is full, and solves them whole (``StepLoop.solve``): the
  answers go out together at the end of the execute. A batch holds only requests that carry the same inputs as
  its oldest (the model has optional inputs: Triton's ``RequiredEqualInputs`` lets a request join only with the
  same input names, and the first that differs closes the batch): a START, with its prompt, is never batched with
  a later chunk of another stream, which waits for the next execute (seen in the server's traces: a chunk queued
  behind a START waited a whole execute more, 0.9-1.2 s at 1 C spread over 2 s);
* ``deadline``: each instance's loop runs one iteration at a time (``StepLoop.run_once``: least slack first
  within the step budget, late chunks given fewer steps); a chunk joins at the iteration after it arrives and is
  answered at the end of the iteration that made its last step. The loop decides by what its instance measures,
  as the server's does: a ``CapacityModel`` starting from the costs given (the price the server's instances
  restore at their start) and timing every call on the virtual clock, so its slack and its fewer steps follow the
  calls' prices as they change with the load.

Instances run side by side, each on its own clock, an execute (or an iteration) taken whole when it begins. On
shared cores they slow each other: an execute is priced between the prices alone and those at load (``loaded``)
by the share of the other instances busy when it begins.

Example (what ``s3flow_tools.sim.streams.run_streams`` drives)::

    server = VirtualServer(RepositorySettings(), costs, HostCosts(transit_s=0.01), n_feats=80)
    server.offer(0.0, corr_id=1, request=chunk_request)     # reaches the server at t = 0
    while server.next_time() is not None:
        for t, corr_id, outcome in server.step():            # answered at t: a ChunkResult or the error
            ...
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from s3flow.engine.capacity import CapacityModel, Costs
from s3flow.engine.planning import ZeroEstimator
from s3flow.engine.sequences import SequenceTable
from s3flow.engine.playback import PlaybackSettings
from s3flow.engine.step_loop import Flight, StepLoop
from s3flow.engine.chunk import ChunkResult
from s3flow.engine.observer import Observer, Observers
from s3flow.engine.streaming import StreamingEngine
from s3flow.protocol import ChunkRequest, RequestError
from s3flow.repository.settings import RepositorySettings


@dataclass(frozen=True)
class HostCosts:
    """What a chunk costs beyond its network calls: the solver's Python per chunk (``chunk_s``) and per Euler step
    (``step_s``), on the instance; ``transit_s``, a request's way in plus its answer's way out (client, gRPC,
    the ensemble's hops), on no instance."""
    chunk_s: float = 0.0
    step_s: float = 0.0
    transit_s: float = 0.0


class _Meter:
    """The virtual seconds an instance's calls took since it was last read, priced as alone and as at load."""

    def __init__(self, alone: "Pricing", loaded: "Pricing"):
        self.pricings, self.sums = (alone, loaded), [0.0, 0.0]

    def charge(self, price: Callable[["Pricing"], float]) -> None:
        alone, loaded = self.pricings
        seconds = price(alone)     # (each pricing asked once: a probe counts its calls)
        self.sums[0] += seconds
        self.sums[1] += seconds if loaded is alone else price(loaded)

    def pending(self, loaded_share: float) -> float:
        """The seconds charged since the last ``take``, ``loaded_share`` of the way from the prices alone to those
        at load."""
        alone, loaded = self.sums
        return alone + loaded_share * (loaded - alone)

    def take(self, loaded_share: float) -> float:
        """``pending``, and the count starts again."""
        seconds, self.sums = self.pending(loaded_share), [0.0, 0.0]
        return seconds


@dataclass(frozen=True)
class Pricing:
    """What a call takes on the virtual clock: ``estimator(rows, frames, key_frames)`` (key frames: its frames and
    the frames of the cache it reads), ``encoder(tokens)`` (the padded batch's), and, for ``token2wav``,
    ``vocoder(frames)``: one call for the answers an execute or an iteration makes, on the same device (None:
    ``token2mel``, no vocoder). By default the costs' own linear model; a projection prices by FLOPs
    (``s3flow_tools.measure.projection``)."""
    estimator: Callable[[int, int, int], float]
    encoder: Callable[[int], float]
    vocoder: Optional[Callable[[int], float]] = None

    @classmethod
    def of(cls, costs: Costs) -> "Pricing":
        return cls(lambda rows, frames, key_frames: costs.step_seconds(rows, frames, key_frames - frames),
                   costs.encoder_seconds)


class PricedEncoder:
    """The flow encoder as zeros of the right shapes, each call charged its price."""

    def __init__(self, n_feats: int, meter: _Meter):
        self.n_feats, self.meter = n_feats, meter

    def __call__(self, tokens, token_len, embedding):
        n = int(tokens.numel())
        self.meter.charge(lambda pricing: pricing.encoder(n))
        b, frames = tokens.shape[0], 2 * tokens.shape[1]
        return torch.zeros(b, self.n_feats, frames), None, torch.zeros(b, self.n_feats)


class PricedEstimator(ZeroEstimator):
    """The estimator as zeros (and empty caches), each call charged its price."""

    def __init__(self, meter: _Meter):
        super().__init__()
        self.meter = meter

    def __call__(self, inputs):
        rows, frames = int(inputs.x.shape[0]), int(inputs.x.shape[2])
        keys = frames + (0 if inputs.past is None else int(inputs.past.mask.shape[-1]))
        self.meter.charge(lambda pricing: pricing.estimator(rows, frames, keys))
        out = super().__call__(inputs)
        self.calls.clear()   # (ZeroEstimator records each call: not kept here)
        return out


@dataclass(order=True)
class _Waiting:
    arrived: float
    order: int
    corr_id: int = field(compare=False)
    request: ChunkRequest = field(compare=False)
    inputs: Optional[frozenset] = field(compare=False, default=None)   # the names it carries (None: any batch)


class _Counts(Observer):
    """What the server's ``s3flow_fewer_steps_chunks_total`` counts, of one instance."""

    def __init__(self):
        self.fewer_steps_chunks = 0

    def fewer_steps(self, corr_id, full: int, steps: int) -> None:
        self.fewer_steps_chunks += 1


class _Instance:
    """One solver instance: its engine, its loop, its queue and its own clock."""

    def __init__(self, settings: RepositorySettings, costs: Costs, pricing: Pricing, loaded: Pricing, host: HostCosts,
                 n_feats: int, meanflow: bool, others_busy: Callable[["_Instance", float], float]):
        self.meter, self.vocodes = _Meter(pricing, loaded), pricing.vocoder is not None
        self.others_busy, self.loaded_share = others_busy, 0.0
        self.now = 0.0                       # the instance's clock: busy until then
        self.busy_s = 0.0                    # virtual seconds it worked
        self.device_s = 0.0                  # ... of which in network calls (the rest: the host's Python)
        solver, deadlines = settings.solver, settings.solver.deadlines
        table = SequenceTable(solver.sequences, clock=lambda: self.now,
                              playback=PlaybackSettings(deadlines.start_buffer_s, deadlines.first_audio_s))
        self.stepping = settings.scheduling == "deadline"
        # what the instance measures of its calls, as the server's (s3flow.serving.solver_instance): from the
        # costs given, every call timed on the virtual clock; the step loop decides by it
        rows_per_stream = 1 if meanflow or not solver.solving.default_guidance_rate else 2
        self.capacity = CapacityModel(max(1, deadlines.max_step_rows // rows_per_stream) if self.stepping
                                      else settings.batching.max_batch_size, clock=self.clock)
        self.capacity.start_from(costs)
        self.counts = _Counts()
        self.engine = StreamingEngine(PricedEncoder(n_feats, self.meter), PricedEstimator(self.meter),
                                      n_feats=n_feats, meanflow=meanflow, solving=solver.solving,
                                      limits=solver.sequences, table=table, observer=Observers(self.counts,
                                                                                              self.capacity),
                                      timer=self.clock)
        self.loop = StepLoop(self.engine, policy="deadline", budget=deadlines.budget(), costs=self.capacity.costs,
                             min_steps=deadlines.min_steps, timer=self.clock) if self.stepping else None
        self.host, self.max_batch = host, settings.batching.max_batch_size
        self.queue_delay_s = settings.batching.max_queue_delay_us * 1e-6
        self.waiting: list[_Waiting] = []
        #: the sequences it holds: corr_id -> when its slot frees (its END answered; inf while it lives)
        self.held: dict[int, float] = {}
        self._done: list[Flight] = []        # the deadline loop's answers (its callbacks) since the last iteration

    def clock(self) -> float:
        """The instance's time, the calls charged since it last moved included (what a call is timed by)."""
        return self.now + self.meter.pending(self.loaded_share)

    def next_action(self) -> Optional[float]:
        """When the instance next does something of its own accord (None: it waits for a request)."""
        if self.stepping and self.loop.busy:
            return self.now
        if not self.waiting:
            return None
        first = min(self.waiting).arrived
        if self.stepping:
            return max(self.now, first)
        ready = first if len({w.corr_id for w in self.waiting}) >= self.max_batch else first + self.queue_delay_s
        return max(self.now, ready)

    def act(self, at: float) -> list[tuple[float, int, object]]:
        """Do the next thing at ``at`` (>= ``next_action()``): its answers, (time, corr_id, outcome) each."""
        self.now = max(self.now, at)
        began = self.now
        self.loaded_share = self.others_busy(self, began)
        try:
            return self._iterate() if self.stepping else self._execute()
        finally:
            self.busy_s += self.now - began

    def _admit(self, w: _Waiting, answers: list):
        """The engine's admission of one request: its chunk, or None when it is answered at once."""
        try:
            chunk = self.engine.admit(w.corr_id, w.request)
        except RequestError as exc:
            answers.append((self.now, w.corr_id, exc))
            return None
        if isinstance(chunk, ChunkResult):   # (a chunk sent again: its answer again)
            answers.append((self.now, w.corr_id, chunk))
            return None
        return chunk

    def _execute(self) -> list:
        """``fifo``: one execute of up to ``max_batch`` oldest waiting chunks, one per sequence, solved whole."""
        batch, seen = [], set()
        for w in sorted(self.waiting):
            if w.arrived > self.now or len(batch) == self.max_batch:
                break
            if batch and w.inputs is not None and w.inputs != batch[0].inputs:
                break      # other inputs than the batch's oldest: Triton closes the batch there
            if w.corr_id not in seen:
                batch.append(w)
                seen.add(w.corr_id)
        self.waiting = [w for w in self.waiting if w not in batch]
        answers: list = []
        chunks = [(w, c) for w in batch if (c := self._admit(w, answers)) is not None]
        steps_before = self.engine.whole.steps
        done = self.engine.solve([c for _, c in chunks]) if chunks else []
        steps = self.engine.whole.steps - steps_before
        began, self.now = self.now, self.now + self._calls() + self.host.chunk_s * len(batch) + self.host.step_s * steps
        # what the server's execute reports to its capacity model: its calls and its Python, not the vocoder's
        self.capacity.worked(self.now - began, len(self.engine.sequences))
        outcomes = [self._outcome(d) for d in done]
        self._vocode(outcomes)
        answers += [(self.now, w.corr_id, o) for (w, _), o in zip(chunks, outcomes)]
        self._forget_ended(chunks)
        return answers

    def _iterate(self) -> list:
        """``deadline``: the chunks arrived by now join, then one iteration of the step loop."""
        answers: list = []
        arrived = [w for w in self.waiting if w.arrived <= self.now]
        self.waiting = [w for w in self.waiting if w.arrived > self.now]
        taken = 0
        for w in sorted(arrived):
            chunk = self._admit(w, answers)
            if chunk is not None:
                self.loop.submit(chunk, lambda d: self._done.append(d))
                self.now += self.host.chunk_s
                taken += 1
        steps_before = self.loop.steps
        self.loop.run_once()   # (reports the time of its calls to the capacity model: ``worked``)
        steps_s = self.host.step_s * (self.loop.steps - steps_before)
        self.now += self._calls() + steps_s
        host_s = self.host.chunk_s * taken + steps_s
        if host_s > 0:   # ... and the host's Python around them, as the server's iteration time holds it
            self.capacity.worked(host_s, len(self.engine.sequences))
        done, self._done = self._done, []
        outcomes = [self._outcome(d) for d in done]
        self._vocode(outcomes)
        answers += [(self.now, d.chunk.corr_id, o) for d, o in zip(done, outcomes)]
        self._forget_ended([(None, d.chunk) for d in done])
        return answers

    def _vocode(self, outcomes: list) -> None:
        """``token2wav``: the answers' frames vocoded on the same device before they go out, in one batched call."""
        if self.vocodes:
            frames = sum(int(o.mel.shape[1]) for o in outcomes if hasattr(o, "mel"))
            if frames:   # one batched call for the execute's (or the iteration's) answers
                self.meter.charge(lambda pricing: pricing.vocoder(frames))
            self.now += self._calls()

    def _calls(self) -> float:
        """The network calls' seconds since the last look (counted as the device's)."""
        seconds = self.meter.take(self.loaded_share)
        self.device_s += seconds
        return seconds

    @staticmethod
    def _outcome(d: Flight):
        return d.result if d.result is not None else d.cause

    def _forget_ended(self, chunks) -> None:
        for _, c in chunks:
            if c.finalize:
                self.held[c.corr_id] = self.now   # (the execute's end: Triton frees the slot then)


class VirtualServer:
    """The solver instances of a repository built with ``settings`` (module docstring), on a virtual clock."""

    def __init__(self, settings: RepositorySettings, costs: Costs, host: HostCosts = HostCosts(), *, n_feats: int,
                 meanflow: bool = False, pricing: Optional[Pricing] = None, loaded: Optional[Pricing] = None):
        """``costs``: the price the instances start from (a server's instances restore the last one's), what their
        step loops decide by until their own calls are timed (then by what they measure, as the server's);
        ``pricing``: what the calls take on an instance working alone (default: the same costs);
        ``loaded``: what they take while every other instance works too (instances share the host's cores: the CPU
        layout's 2 solvers carry 1.42x one, not 2x, results/layout.md). An execute (or an iteration) is priced
        between the two by the share of the other instances busy when it begins (default: ``pricing`` always)."""
        if not costs.known:
            raise ValueError("the simulator needs known costs (est_fixed or est_per_unit > 0)")
        self.host, self.n_feats = host, n_feats
        pricing = pricing or Pricing.of(costs)
        self.instances = [_Instance(settings, costs, pricing, loaded or pricing, host, n_feats, meanflow,
                                    self._others_busy)
                          for _ in range(settings.batching.solver_instances)]
        self._home: dict[int, _Instance] = {}
        self._order = itertools.count()

    @property
    def fewer_steps_chunks(self) -> int:
        """Chunks the instances gave fewer Euler steps than their stream's (the server's counter of that name)."""
        return sum(i.counts.fewer_steps_chunks for i in self.instances)

    def _others_busy(self, instance: "_Instance", at: float) -> float:
        """The share of the instances other than ``instance`` at work at ``at`` (busy until after it)."""
        others = [i for i in self.instances if i is not instance]
        return sum(i.now > at for i in others) / len(others) if others else 0.0

    def offer(self, at: float, corr_id: int, request: ChunkRequest, inputs: Optional[frozenset] = None) -> None:
        """A request reaches the server at ``at`` (its START picks the instance that holds the fewest); ``inputs``:
        the names of the tensors it carries (``fifo`` batches only requests with the same; None: any)."""
        if request.start or corr_id not in self._home:
            for i in self.instances:   # slots freed by now
                i.held = {c: until for c, until in i.held.items() if until > at}
            home = min(self.instances, key=lambda i: len(i.held))
            self._home[corr_id] = home
            home.held[corr_id] = float("inf")
        home = self._home[corr_id]
        home.waiting.append(_Waiting(at, next(self._order), corr_id, request, inputs))

    def next_time(self) -> Optional[float]:
        """When an instance next acts (None: every one waits for requests)."""
        times = [t for i in self.instances if (t := i.next_action()) is not None]
        return min(times) if times else None

    def step(self) -> list[tuple[float, int, object]]:
        """The instance due first acts; its answers, (time at the server, corr_id, ChunkResult or the error)."""
        due = min((i for i in self.instances if i.next_action() is not None), key=lambda i: i.next_action())
        return due.act(due.next_action())
