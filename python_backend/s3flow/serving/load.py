"""The server's load as its models see it: each instance's demand, summed where admission reads it.

The solver and the vocoder instances are separate stub processes, and admission is another: each stateful
instance writes a small :class:`LoadReport` (JSON, in the server's ``load`` folder under ``/dev/shm``) at once when
the streams it holds change, else at most every second (its cost fits and each stream's work so far), and
admission reads them all (:class:`LoadBoard`) into one :class:`ServerLoad`, which prices the work
(``s3flow.engine.capacity.Costs``), each solver call's fixed part shared by all the solver's streams (those held,
the STARTs admitted but not yet held, and the one asking):

* ``stages(steps, guidance_rate, pending, audio)``: for the solver and (token2wav) the vocoder, a :class:`Stage`:
  the summed demand of the streams it holds (device seconds per second; the solver's with the STARTs admitted but
  not yet held) and what a new START adds to it (the solver's: the default plan at the START's own steps and
  guidance; the vocoder's: its per-stream demand, for a START that asks for audio, ``audio``). A ``token2wav``
  stream (one a vocoder holds, or a START that asks for audio) takes more of the solver than a ``token2mel`` one
  by ``wav_factor``, the solver's capacity over token2wav's (``wav_capacity``: the two device times added, the
  solver and the vocoder sharing one device). A stream fits when it fits every stage, and
  the server's ``utilization`` is the busiest stage's;
* ``capacity``: audio seconds per second of default streams at full batches, measured from the solver's work
  (``CapacityModel.capacity``, summed over the solver instances; ``wav_capacity``: token2wav's, the solver's
  and the vocoder's device time together); each solver demand is scaled so that N default streams need N /
  capacity wherever they are held (the costs only price one stream against another), and a START is priced on
  the solver instance holding the fewest streams;
* ``wait_until(stage, target, expected_s)``: the time until ``stage`` has room for its ``need`` under ``target``,
  looking ahead: streams end, each assumed to last ``expected_s`` of audio (no stream says how long it will be),
  and the solver's young streams leave their costly start (STARTs that came together go in one after another).

Example::

    files = LoadBoard(LoadBoard.default_folder())
    InstanceLoad(files, "cfm_solver_0", "solver", capacity_model, *planned_start(settings, 80, False)).publish(
        table.works(), table.recently_ended())
    load = files.read()
    load.utilization(), load.capacity, load.stages()
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from s3flow_contract.tensors import FRAMES_PER_SECOND
from s3flow.engine.capacity import CapacityModel, Costs, Plan, Work
from s3flow.serving.records import server_folder, writer_watch, writer_watched
from s3flow.serving.report_board import ReportBoard


#: the board's file in the server's ``load`` folder
BOARD = "board"
#: how finely ``ServerLoad.wait_until`` looks ahead (seconds)
WAIT_STEP_S = 0.2
#: the share of the smaller of the solver's and the vocoder's device time per audio second that token2wav adds
#: to the larger (``ServerLoad.wav_capacity``). Measured on 2 cores (the trained small model, results/qos.md):
#: the smaller capacity (0) read 1.1-1.4x of the C token2wav made over a run and a burst priced by it stalled;
#: the two times added (1) read 0.61-0.80x (2 of 74 samples within 25 %); 0.5 read 0.80-0.96x and 0.77-1.00x
#: (69 of 69 and 74 of 74 within 25 %; docs/reliability.md). Fitted on that host: unmeasured on a GPU
VOCODER_OVERLAP = 0.5


def _work(w: Work) -> list:
    return list(dataclasses.astuple(w))


@dataclass
class LoadReport:
    """One instance's: its ``costs`` (``s3flow.engine.capacity.Costs``), the ``streams`` it follows (corr_id ->
    their ``Work`` so far) and those it holds with nothing answered yet (``waiting``); a solver's ``planned``
    default utterance (``s3flow.engine.capacity.Plan``, at ``planned_steps`` Euler steps of ``planned_rows``
    estimator rows: 2 guided), which its streams are priced against. A vocoder has no plan: its streams are
    priced by their own work."""
    kind: str                              # "solver" | "vocoder"
    costs: Costs = field(default_factory=Costs)
    streams: dict = field(default_factory=dict)
    waiting: list = field(default_factory=list)
    planned: Optional[Plan] = None
    planned_steps: int = 0
    planned_rows: int = 0
    #: audio seconds per second the instance makes at full batches, measured from its recent work
    #: (``CapacityModel.capacity``; a solver's, before it has served any: its calibrated costs' for the plan)
    capacity: float = 0.0
    #: what it is made of (diagnostics): audio per busy second in the window, the busy share at capacity
    throughput: float = 0.0
    duty: float = 1.0
    #: a solver's: the most live sequences it may hold (``max_live_sequences``: admission's cap), and the
    #: sequences whose END it answered in the last moments (their last mel may still be on its way to the vocoder)
    cap: int = 0
    ended: list = field(default_factory=list)
    #: the writer's process (0: not named): a report whose writer died does not count (``LoadBoard.read``)
    pid: int = 0
    #: when the writer's instance was made (wall clock): a vocoder made after a solver's answer was sent on never
    #: got that answer (its stub died with it and was reloaded, ``s3flow.serving.arrivals.Delivery``)
    started: float = 0.0
    #: a vocoder's: the last time it was seen with nothing queued for it (``VocoderInstance.free_at``; wall clock;
    #: 0: never): an answer the solver sent on well before then reached it or never will (its client cancelled it in
    #: the ensemble: ``Delivery``)
    free_at: float = 0.0

    #: what prices an instance's work (the rest is its own streams and life)
    PRICE = ("costs", "planned", "planned_steps", "planned_rows", "capacity", "throughput", "duty")

    @property
    def priced(self) -> bool:
        """Whether it has priced its work: its costs known and (a solver) its plan made."""
        return self.costs.known and (self.planned is not None or self.kind != "solver")

    def priced_as(self, other: "LoadReport") -> "LoadReport":
        """This instance's report with ``other``'s price (``PRICE``), its own streams and life kept."""
        return dataclasses.replace(self, **{name: getattr(other, name) for name in self.PRICE})

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "costs": dataclasses.asdict(self.costs),
                           "streams": {str(k): _work(w) for k, w in self.streams.items()},
                           "waiting": [int(c) for c in self.waiting],
                           "planned": None if self.planned is None else {
                               "chunks": [_work(w) for w in self.planned.chunks],
                               "expected_frames": self.planned.expected_frames,
                               "start_buffer_s": self.planned.start_buffer_s},
                           "planned_steps": self.planned_steps, "planned_rows": self.planned_rows,
                           "capacity": self.capacity, "throughput": self.throughput, "duty": self.duty,
                           "cap": self.cap, "ended": [int(c) for c in self.ended], "pid": self.pid,
                           "started": self.started, "free_at": self.free_at})

    @classmethod
    def from_json(cls, text: str) -> "LoadReport":
        d = json.loads(text)
        return cls(kind=d["kind"], costs=Costs(**d["costs"]),
                   streams={int(k): Work(*v) for k, v in d["streams"].items()},
                   waiting=[int(c) for c in d["waiting"]],
                   planned=None if d["planned"] is None else Plan([Work(*w) for w in d["planned"]["chunks"]],
                                                                  int(d["planned"]["expected_frames"]),
                                                                  float(d["planned"]["start_buffer_s"])),
                   planned_steps=int(d["planned_steps"]), planned_rows=int(d["planned_rows"]),
                   capacity=float(d.get("capacity", 0.0)), throughput=float(d.get("throughput", 0.0)),
                   duty=float(d.get("duty", 1.0)), cap=int(d.get("cap", 0)),
                   ended=[int(c) for c in d.get("ended", [])], pid=int(d.get("pid", 0)),
                   started=float(d.get("started", 0.0)), free_at=float(d.get("free_at", 0.0)))

    @functools.cached_property
    def planned_capacity(self) -> float:
        """What the costs say the instance makes of default streams at full batches (the plan's; a report is read
        once and priced many times)."""
        return self.costs.capacity(self.planned.expected()) if self.planned is not None else 0.0

    def _scale(self, capacity: Optional[float] = None) -> float:
        """A solver's demands are the plan's relative to the measured capacity: the costs price one stream against
        another (a young one needs more, one at more steps more), the work measures how much the device makes
        (``capacity``: this instance's, or the server's where several solver instances share it), so that N
        default streams need N / capacity of the device."""
        planned, capacity = self.planned_capacity, self.capacity if capacity is None else capacity
        return planned / capacity if planned > 0 and capacity > 0 else 1.0

    def planned_demand(self, share: float, steps: Optional[int] = None, guidance_rate: Optional[float] = None,
                       capacity: Optional[float] = None) -> float:
        """A START's demand by the plan, at its own ``steps`` and ``guidance_rate`` (None: the defaults), against
        ``capacity`` (None: this instance's)."""
        if self.planned is None or not self.costs.known:
            return 0.0
        rows = self.planned_rows if guidance_rate is None or self.planned_rows == 1 else (2 if guidance_rate else 1)
        ratio = (steps or self.planned_steps) * rows / max(self.planned_steps * self.planned_rows, 1)
        return self._scale(capacity) * self.planned.start_need(
            self.costs, share, ratio, (steps or self.planned_steps) / max(self.planned_steps, 1))

    def stream_demand(self, work: Work, share: float, capacity: Optional[float] = None) -> float:
        """A stream's demand by its work so far: against the plan (``Plan.demand``), or (no plan: the vocoder)
        its own work's; against ``capacity`` (None: this instance's)."""
        if self.planned is None:
            return self.costs.demand(work, share)
        return self._scale(capacity) * self.planned.demand(self.costs, work, share) if self.costs.known else 0.0

    def demand(self, extra: int = 0, capacity: Optional[float] = None) -> dict:
        """corr_id -> device s per s of every stream it holds (one with no audio yet: by the plan), each call's
        fixed part shared by the streams held plus ``extra`` more, against ``capacity`` (None: this instance's)."""
        share = self.costs.share(self.held + extra)
        out = {c: self.stream_demand(w, share, capacity) for c, w in self.streams.items()}
        out.update({c: self.planned_demand(share, capacity=capacity) for c in self.waiting if c not in out})
        return out

    @property
    def held(self) -> int:
        """The streams it holds, answered or not."""
        return len(self.streams) + len(self.waiting)

    @property
    def utilization(self) -> float:
        return sum(self.demand().values())


@dataclass
class Stage:
    """One stage of the server's work (the solver, or the vocoder) as admission weighs it: ``now`` the summed
    demand of what it holds (device seconds per second), ``need`` what a new START adds."""
    name: str
    now: float
    need: float

    def fits(self, target: float) -> bool:
        return self.now + self.need <= target


@dataclass
class ServerLoad:
    """The reports of a server's instances, summed (module docstring). ``LoadBoard.read`` hands out the same
    object while no report changes, so what it prices is kept per question: a burst of STARTs refused against one
    load asks the same ones (the look-ahead of ``wait_until`` was most of a refusal's time)."""
    reports: list
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        """A solver instance not yet priced is priced as a sibling that is: the instances of one model on one host
        are alike, and one that took a new server's first stream cannot calibrate until it ends (its calibration
        waits for an idle engine), so a burst's STARTs waited for that stream's served calls (about 1 s more on a
        new server with the CPU layout's two)."""
        priced = next((r for r in self.reports if r.kind == "solver" and r.priced), None)
        if priced is not None:
            self.reports = [r.priced_as(priced) if r.kind == "solver" and not r.priced else r for r in self.reports]

    def _kept(self, key: tuple, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    @property
    def _solvers(self) -> list:
        return [r for r in self.reports if r.kind == "solver"]

    @property
    def solver_ids(self) -> set:
        """The sequences the solver instances hold."""
        return {c for r in self._solvers for c in list(r.streams) + r.waiting}

    @property
    def cap(self) -> int:
        """The most live sequences the solver instances may hold together (0: none reports)."""
        return sum(r.cap for r in self._solvers)

    @property
    def solver_recent_ids(self) -> set:
        """The sequences the solver instances hold, or whose END they answered in the last moments."""
        return self.solver_ids | {c for r in self._solvers for c in r.ended}

    @property
    def known(self) -> bool:
        """Whether the solver instances have priced their work (each its calibration at load, or its first timed
        calls; one priced prices its siblings, ``__post_init__``): before, admission cannot judge a START by
        capacity."""
        return bool(self._solvers) and all(r.priced for r in self._solvers)

    def known_for(self, audio: Optional[bool]) -> bool:
        """:attr:`known`, and for a START that asks for audio (``token2wav``'s) the vocoder instances' prices too
        (each its calibration right after the solver's, or its first timed pushes)."""
        return self.known and (audio is not True or all(r.capacity > 0 for r in self.reports if r.kind == "vocoder"))

    @property
    def capacity(self) -> float:
        """``token2mel``'s: audio seconds per second of default streams at full batches, the solver instances'
        summed (each measures what it makes while the others work beside it: results/layout.md)."""
        return sum(r.capacity for r in self._solvers)

    def _entry(self) -> Optional[LoadReport]:
        """The priced solver instance a new START is expected on: the one holding the fewest streams (Triton's
        sequence batcher hands a new sequence the lowest free slot index over its instances, so they fill
        evenly); None before any solver has priced its work."""
        solvers = [r for r in self._solvers if r.priced]
        return min(solvers, key=lambda r: r.held) if solvers else None

    @property
    def vocoders_since(self) -> Optional[float]:
        """When the oldest vocoder instance reporting now was made (None: none reports)."""
        started = [r.started for r in self.reports if r.kind == "vocoder"]
        return min(started) if started else None

    def vocoder_free_at(self, corr_id: int) -> Optional[float]:
        """When the vocoder instance that holds ``corr_id`` was last seen free (the earliest of them all when none
        holds it yet; None: no vocoder reports)."""
        vocoders = [r for r in self.reports if r.kind == "vocoder"]
        holding = [r for r in vocoders if corr_id in r.streams or corr_id in r.waiting] or vocoders
        return min(r.free_at for r in holding) if holding else None

    @property
    def vocoder_capacity(self) -> float:
        """Audio seconds per second the vocoder makes at full batches (its instances' best; 0: not priced)."""
        return max((r.capacity for r in self.reports if r.kind == "vocoder"), default=0.0)

    @property
    def wav_capacity(self) -> float:
        """``token2wav``'s: the solver and the vocoder share one device (cores, or one GPU), so a second of
        token2wav audio takes the larger of their device times per audio second (one over each's capacity) and
        ``VOCODER_OVERLAP`` of the smaller: each figure is measured with the other working beside it some of the
        time, so neither the smaller of the two capacities (their times overlapping whole) nor the two times added
        (not at all) is what token2wav makes; the solver's alone while the vocoder has no price."""
        solver, vocoder = self.capacity, self.vocoder_capacity
        if solver <= 0 or vocoder <= 0:
            return solver
        s, v = 1.0 / solver, 1.0 / vocoder
        return 1.0 / (max(s, v) + VOCODER_OVERLAP * min(s, v))

    def utilization(self, pending: int = 0) -> float:
        """The busiest stage's demand (module docstring), with ``pending`` more STARTs by the default plan
        (admitted, not yet held)."""
        vocoder = self._vocoder_stage(None)
        return max(self._solver_now(pending, pending, False), vocoder.now if vocoder else 0.0)

    def stages(self, steps: Optional[int] = None, guidance_rate: Optional[float] = None,
               pending: int = 0, audio: Optional[bool] = None) -> list:
        """The solver's :class:`Stage` and, where a vocoder reports and the START may go through it, the vocoder's,
        for a START at its own ``steps`` and ``guidance_rate`` after ``pending`` more like it: every solver stream
        priced with the calls' fixed part shared by the START too (as it will be), so a stream held and one asking
        are priced alike. ``audio``: whether the START is ``token2wav``'s (True), ``token2mel``'s (False: it
        needs no vocoder) or not known (None: the vocoder's mean stream times the share of streams that vocode)."""
        return self._kept(("stages", steps, guidance_rate, pending, audio),
                          lambda: self._stages(steps, guidance_rate, pending, audio))

    def _stages(self, steps: Optional[int], guidance_rate: Optional[float], pending: int,
                audio: Optional[bool]) -> list:
        need = self._solver_need(steps, guidance_rate, pending) * (self.wav_factor if audio else 1.0)
        out = [Stage("solver", self._solver_now(pending, pending + 1, bool(audio)), need)]
        vocoder = self._vocoder_stage(audio) if audio is not False else None
        return out + [vocoder] if vocoder else out

    @property
    def wav_factor(self) -> float:
        """How much more of the solver's device a ``token2wav`` stream takes than a ``token2mel`` one: the
        solver's capacity over token2wav's (``wav_capacity``; >= 1): the vocoder's part of the device (issue 48:
        after the solver's calibration alone, token2wav's STARTs were priced as token2mel's and a burst of 6 all
        stalled)."""
        def factor():
            wav = self.wav_capacity
            return max(self.capacity / wav, 1.0) if wav > 0 else 1.0
        return self._kept(("wav_factor",), factor)

    @property
    def _vocoded(self) -> set:
        """The sequences a vocoder instance holds: ``token2wav``'s (asked at every step of a look-ahead)."""
        return self._kept(("vocoded",), lambda: {c for r in self.reports if r.kind == "vocoder"
                                                 for c in list(r.streams) + r.waiting})

    def _vocoder_stage(self, audio: Optional[bool]) -> Optional[Stage]:
        """The vocoders' streams' summed demand, and a START's need (None: no vocoder reports): a ``token2wav``
        START's (``audio``), their mean stream's, or with none held the vocoders' price of one stream making audio
        in real time (one over their capacity); one not known, the mean stream's times the share of the solver's
        streams that go through a vocoder."""
        vocoders = [r for r in self.reports if r.kind == "vocoder"]
        if not vocoders:
            return None
        demand = {c: d for v in vocoders for c, d in v.demand().items() if d > 0}
        mean = sum(demand.values()) / len(demand) if demand else 0.0
        live = self.solver_ids
        if audio:
            capacity = self.vocoder_capacity
            need = mean if demand else (1.0 / capacity if capacity > 0 else 0.0)
        else:
            need = mean * min(1.0, len(demand) / len(live)) if demand and live else 0.0
        return Stage("vocoder", sum(demand.values()), need)

    def _solver_now(self, pending: int, sharing: int, audio: bool) -> float:
        """The solvers' streams' summed demand, and ``pending`` more by the default plan (``token2wav``'s if
        ``audio``), each solver call's fixed part shared by them all and ``sharing`` more; a stream a vocoder holds
        is ``token2wav``'s (``wav_factor``)."""
        capacity, vocoded, factor = self.capacity, self._vocoded, self.wav_factor
        total = sum(d * (factor if c in vocoded else 1.0)
                    for r in self._solvers for c, d in r.demand(sharing, capacity).items())
        r = self._entry()
        if pending and r is not None:
            total += pending * r.planned_demand(r.costs.share(r.held + sharing), capacity=capacity) * \
                (factor if audio else 1.0)
        return total

    def _solver_need(self, steps: Optional[int], guidance_rate: Optional[float], pending: int) -> float:
        """What a new START adds to the solver: the default plan at its own ``steps`` and ``guidance_rate``,
        sharing calls with the streams held and ``pending`` more."""
        r = self._entry()
        if r is None:
            return 0.0
        return r.planned_demand(r.costs.share(r.held + pending + 1), steps, guidance_rate, self.capacity)

    def wait_until(self, stage: Stage, target: float, expected_s: float, pending: int = 0,
                   audio: bool = False) -> float:
        """Seconds until ``stage`` has room for its ``need`` under ``target``, looked at every ``WAIT_STEP_S``: in
        that time each stream makes as much more audio by the plan (the solver: a young stream's demand falls as it
        leaves its costly start, so STARTs that come together are let in one after another) and those past
        ``expected_s`` of audio end (one older than that is taken to end within the next second); 0 if there is
        room now, ``expected_s`` if even their ending is not enough. ``audio``: the ``pending`` STARTs are
        ``token2wav``'s (``stages``)."""
        return self._kept(("wait", stage.name, stage.need, target, expected_s, pending, audio),
                          lambda: self._wait_until(stage, target, expected_s, pending, audio))

    def _wait_until(self, stage: Stage, target: float, expected_s: float, pending: int, audio: bool) -> float:
        if stage.fits(target):
            return 0.0
        for k in range(1, int(expected_s / WAIT_STEP_S) + 1):
            ahead = k * WAIT_STEP_S
            load = self._solver_ahead(ahead, expected_s, pending, audio) if stage.name == "solver" else \
                self._vocoder_ahead(ahead, expected_s)
            if load + stage.need <= target:
                return k * WAIT_STEP_S
        return expected_s

    def _vocoder_ahead(self, ahead: float, expected_s: float) -> float:
        """The vocoder's demand ``ahead`` seconds from now: that of its streams still going then."""
        return sum(d for v in self.reports if v.kind == "vocoder" for c, d in v.demand().items()
                   if ahead < max(expected_s - v.streams.get(c, Work()).frames / FRAMES_PER_SECOND, 1.0))

    def _solver_ahead(self, ahead: float, expected_s: float, pending: int, audio: bool) -> float:
        """The solvers' demand ``ahead`` seconds from now, each stream further along the plan, with ``pending``
        more STARTs as far along (``token2wav``'s if ``audio``)."""
        load, capacity, entry = 0.0, self.capacity, self._entry()
        vocoded, factor = self._vocoded, self.wav_factor
        for r in self._solvers:
            if r.planned is None:
                continue
            made = {c: r.streams[c].frames if c in r.streams else 0 for c in list(r.streams) + r.waiting}
            left = {c: f for c, f in made.items()
                    if ahead < max(expected_s - f / FRAMES_PER_SECOND, 1.0)}   # those still going then
            share = r.costs.share(len(left) + pending + 1)   # the START asking shares the calls too
            for c, f in left.items():
                work = r.streams.get(c, Work())
                later = dataclasses.replace(work)
                later.add(r.planned.window(f, ahead * FRAMES_PER_SECOND))
                load += r.stream_demand(later, share, capacity) * (factor if c in vocoded else 1.0)
            if pending and r is entry:
                load += pending * r.stream_demand(r.planned.prefix(ahead * FRAMES_PER_SECOND), share, capacity) * \
                    (factor if audio else 1.0)
        return load


class LoadBoard:
    """The instances' reports on the server's board (``s3flow.serving.report_board``: a lane each, in shared
    memory). A reader parses a report again only when its lane changed, and hands out the same ``ServerLoad`` while
    none did (a burst of STARTs refused against one load prices it once)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.board = ReportBoard(self.folder / BOARD)
        self._parsed: dict = {}                    # instance -> (its payload, its LoadReport)
        self._load: tuple = (None, ServerLoad([]))   # (the lanes' versions and the writers alive, their ServerLoad)
        self._read_at = float("-inf")              # when the board was last read (monotonic)

    @staticmethod
    def default_folder(server_pid: Optional[int] = None) -> Path:
        return server_folder("load", server_pid)

    def write(self, instance: str, report: LoadReport) -> None:
        self.board.write(instance, report.to_json().encode())

    def remove(self, instance: str) -> None:
        self.board.clear(instance)

    def read(self, max_age_s: float = 0.0) -> ServerLoad:
        """Every live instance's last report; one whose writer has died is passed over (its writer's streams are gone
        with it: a dead instance must not refuse traffic on its behalf; ``s3flow.serving.records.writer_watched``).
        ``max_age_s``: what was read that long ago or less will do (the vocoder's idle checks and gauge, the solver's
        ``vocoders_since``); admission reads afresh (0) at every START: memory only, no system call."""
        now = time.monotonic()
        if max_age_s > 0 and now - self._read_at <= max_age_s:
            return self._load[1]
        self._read_at = now
        versions = self.board.versions()
        if self._load[0] is not None and self._load[0][0] == versions and \
                all(writer_watched(pid) for pid in self._load[0][1]):
            return self._load[1]
        alive, parsed = [], {}
        for instance, (pid, payload) in self.board.read().items():
            kept = self._parsed.get(instance)
            if kept is None or kept[0] != payload:
                try:
                    kept = (payload, LoadReport.from_json(payload.decode()))
                except (ValueError, KeyError, TypeError):   # an older server's
                    continue
                writer_watch().wrote(kept[1].pid)   # (a dead writer writes nothing new: a reused PID is alive)
            parsed[instance] = kept
            if writer_watched(kept[1].pid):
                alive.append(kept[1])
        self._parsed = parsed
        self._load = ((versions, tuple(r.pid for r in alive)), ServerLoad(alive))
        return self._load[1]


class InstanceLoad:
    """A stateful instance's side: its ``CapacityModel`` (fed by the engine, or by the vocoder's pushes) and, for
    a solver, the default START's planned work; :meth:`publish` writes its report for admission."""

    def __init__(self, board: LoadBoard, instance: str, kind: str, model: CapacityModel,
                 planned: Optional[Plan] = None, planned_steps: int = 0, planned_rows: int = 0, cap: int = 0,
                 every_s: float = 0.0):
        """``every_s``: while the streams held and just ended stay the same, write at most this often (0: every
        time); a change of them (a START, an END, a drop) is written at once."""
        self.board, self.instance, self.kind, self.model = board, instance, kind, model
        self.planned, self.planned_steps, self.planned_rows = planned, planned_steps, planned_rows
        self.cap, self.every_s = cap, every_s
        self.started = time.time()
        self._written: tuple = (None, float("-inf"))   # ((streams held, just ended), when) of the last report

    def publish(self, works: dict, ended=(), free_at: float = 0.0, force: bool = False) -> Optional[LoadReport]:
        """The report of the streams held now (``works``: corr_id -> its work so far at full steps, the sequence
        table's ``works()``) and of those ``ended`` moments ago, written out and returned; None when it is not due
        (``every_s``; ``force``: now). ``free_at``: when the instance was last free (a vocoder's,
        ``LoadReport.free_at``). Writing the work and the costs, which move at every call, after every answer was
        most of the load report's system calls (issue 49); admission's slot count and "the solver has it" read
        the streams held, written at once."""
        held, now = (set(works), set(ended)), time.monotonic()
        if not force and held == self._written[0] and now - self._written[1] < self.every_s:
            return None
        self._written = (held, now)
        streams = {c: w for c, w in works.items() if w.steps or w.chunks}   # (the rest: nothing answered yet)
        report = LoadReport(self.kind, self.model.costs(), streams, [c for c in works if c not in streams],
                            self.planned, self.planned_steps, self.planned_rows, cap=self.cap,
                            ended=[c for c in ended if c not in works])
        # before any served work: the capacity an earlier instance measured (s3flow.serving.saved_price), or the
        # calibrated costs' for the plan times the same busy share at capacity the live estimate applies (its
        # prior, DUTY_PRIOR: the calibration's calls ran alone)
        prior = report.planned_capacity * self.model.duty if self.planned is not None else 0.0
        report.capacity = self.model.capacity() or self.model.prior_capacity or prior
        report.throughput, report.duty = self.model.throughput, self.model.duty
        report.pid, report.started, report.free_at = os.getpid(), self.started, free_at
        try:
            self.board.write(self.instance, report)
        except OSError:   # admission counts this instance as it last wrote
            pass
        return report

    def remove(self) -> None:
        self.board.remove(self.instance)
