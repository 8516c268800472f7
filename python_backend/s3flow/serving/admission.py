"""Admission: the checks a START must pass before Triton's sequence batcher gives it a slot.

Triton's sequence batcher holds a slot for a sequence from its START until its END or its idle window, even
when the solver answered the START with an error; a refused START left without END keeps its slot that long,
and a new utterance then waits in Triton's backlog. So the ensembles (``token2mel``, ``token2wav``) run a
stateless ``admission`` step first, and the solver waits for its answer (an ``admitted`` tensor): a START
refused there never reaches the sequence batcher and holds nothing. It reads the START as the solver does
(``s3flow.serving.incoming.parse_incoming``) and answers each refusal by the solver's mapping
(``s3flow.serving.incoming.refusal``: code and disposition, ``s3flow_contract.answers``). It refuses:

* a request that does not validate (``s3flow.protocol.parse_request``): ``fail``;
* a voice this server does not hold: ``retry`` with ``resend=prompt``;
* while the server drains: ``resume``;
* when the solver instances hold as many live sequences as they may (the live ids and cap of each instance's
  load report, ``s3flow.serving.load``, written at once on a START, an END or a drop, plus the STARTs admitted in
  the last ``grace_s`` that they have not listed yet, as held or as ended): ``busy`` with a retry time;
* when the stream would take a stage's utilization above ``utilization_target`` (``AdmissionTarget``; a stage: the
  solver, or token2wav's vocoder, ``s3flow.serving.load.Stage``: its live streams' summed demand of the device
  against the capacity measured from their work, plus what this START needs, by the default plan at its own
  steps for the solver, priced as what its ensemble makes: the two ensembles map different outputs of this step,
  ``admitted`` for ``token2mel``, ``admitted_audio`` for ``token2wav``, and a START is priced for the one it
  asks for, a token2wav one with the vocoder's work too, ``ServerLoad.stages``): ``busy``, with ``retry_after``
  the time until the server expects room (young streams past their costly start, or streams of
  ``expected_utterance_s`` ended), clamped to [0.2, 5] s. A server that
  holds no stream takes one whatever its estimate. A server is never open wider than its knowledge: before every
  solver instance has priced its work (its calibration at load, seconds after the server is ready; for a token2wav
  START every vocoder instance too, whose calibration follows the solver's), a START waits for that up to
  ``pricing_wait_s``, and is then refused ``busy`` if the server holds any stream (issue 48: a
  burst right after start-up went in unpriced, 10 of 10, and every one stalled).

Chunks after the START pass unchecked (their sequence holds its slot legitimately; the solver validates them),
except those of a sequence the solver dropped (``gone``: answered ``resume`` with the solver's reason);
they also tell admission that the solver has their sequence (so a short utterance is never counted twice).
The solver keeps every check of its own, so a request sent to it directly is refused as before.

Example::

    admission = Admission(RequestRules(), n_feats=80, load=LoadBoard(folder))
    outcome = admission.check(corr_id=7, start=True, inputs=tensors)   # None: admitted
"""
from __future__ import annotations

import time
from typing import Callable, Mapping, Optional

import numpy as np

from s3flow.engine.capacity import AdmissionTarget
from s3flow.protocol import RequestError, RequestRules, ServerBusy, UnknownSequence
from s3flow.serving.demand import RefusedDemand
from s3flow.serving.load import LoadBoard, ServerLoad
from s3flow.serving.incoming import Draining, Incoming, Outcome, naming_sequence, parse_incoming, refused
from s3flow.serving.voice_registry import UnknownVoice


#: the bounds of a capacity refusal's retry_after (seconds)
MIN_RETRY_S, MAX_RETRY_S = 0.2, 5.0
#: how long a START waits for the solver instances to price their work before it is judged without it (their
#: calibration at load takes a few seconds once the server is ready), and how often it looks
PRICING_WAIT_S, PRICING_POLL_S = 10.0, 0.05


class Admission:
    """Decides whether a request may go on to the solver (module docstring)."""

    def __init__(self, rules: RequestRules, n_feats: int, load: Optional[LoadBoard] = None,
                 voices: Optional[Callable[[str, str], dict]] = None, draining: Callable[[], bool] = lambda: False,
                 name: str = "admission", grace_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 starts=None, seen=None, gone=None, target: AdmissionTarget = AdmissionTarget(),
                 pricing_wait_s: float = PRICING_WAIT_S):
        """``starts``, ``seen``: ``s3flow.serving.arrivals.ArrivalMarks`` for each admitted START (first audio)
        and for every request (a chunk waiting in the queue keeps its sequence from going idle); ``gone``: the
        solver's marks of the sequences it dropped (a later chunk of one is answered here: Triton freed its
        slot, so it would never reach the solver); ``load``: the instances' load reports (their live sequences and
        cap; admission by capacity, with ``capacity``'s target and expected utterance length); ``pricing_wait_s``:
        how long a START waits for the solver instances to price their work (module docstring)."""
        self.pricing_wait_s = pricing_wait_s
        self.rules, self.n_feats, self.voices, self.draining = rules, n_feats, voices, draining
        self.load, self.target = load, target
        self.starts, self.seen, self.gone = starts, seen, gone
        self.name, self.grace_s, self.clock = name, grace_s, clock
        self._admitted: dict[int, float] = {}       # STARTs admitted and perhaps not yet counted: id -> time
        self.refused = RefusedDemand(clock=clock)   # STARTs refused for room lately, by their price

    def check(self, corr_id: int, start: bool, end: bool, inputs: Mapping[str, np.ndarray],
              tenant: str = "", audio: Optional[bool] = None) -> Optional[Outcome]:
        """None to let the request through, else the refusal (with its code and disposition). ``audio``: the
        START is ``token2wav``'s (True), ``token2mel``'s (False) or not known (None): what it is priced at."""
        if not start:   # a later chunk: its START reached the solver, which counts the sequence from then on
            self._admitted.pop(corr_id, None)
            gone = self.gone.note(corr_id) if self.gone is not None else None
            if gone is not None:   # the solver dropped it and gave Triton its slot back
                return self._refuse(corr_id, UnknownSequence(f"sequence {corr_id} is not active: {gone}"), "gone")
            if self.seen is not None:
                self.seen.count(corr_id, start=False)
            return None
        if self.gone is not None:
            self.gone.take(corr_id)   # the id starts a new sequence
        try:
            req = parse_incoming(Incoming(corr_id, start=True, end=end, inputs=inputs, tenant=tenant), self.rules,
                                 self.n_feats, self.voices)
        except RequestError as exc:
            return self._refuse(corr_id, exc, "voice" if isinstance(exc, UnknownVoice) else "invalid")
        if self.draining():
            return self._refuse(corr_id, Draining(), "draining")
        if self.load is not None:
            now = self.clock()
            load = self.load.read()
            live, cap = load.solver_ids, load.cap
            seen = load.solver_recent_ids   # held now, or ended in the last moments: counted by the solver
            self._admitted = {c: t for c, t in self._admitted.items() if now - t <= self.grace_s and c not in seen}
            held = len(live) + len(self._admitted) - (corr_id in live)   # a restart on a live id takes no slot
            if cap and held >= cap:
                wait = self.grace_s
                self._note_refused(corr_id, load, audio)
                return self._refuse(corr_id, ServerBusy(f"too many live sequences ({held}, max_live_sequences "
                                                        f"{cap}); retry in {wait:.1f} s", wait), "live")
            if self.target.utilization_target > 0:
                refusal = self._over_capacity(corr_id, req, load, audio)
                if refusal is not None:
                    return refusal
            # stamped when admitted, not when it came: a START that waited for the price (seconds) and was then
            # stamped with its arrival left the count at once, so the STARTs queued behind it each saw none
            # pending (issue 48: a new server admitted 7-8 of a burst, every one of them stalled)
            self._admitted[corr_id] = self.clock()
            self.refused.admitted(corr_id)
        if self.starts is not None:
            self.starts.mark(corr_id)
        if self.seen is not None:
            self.seen.count(corr_id, start=True)
        return None

    def _refuse(self, corr_id: int, exc: RequestError, reason: str) -> Outcome:
        """The refusal ``exc`` answered as the solver answers it (``incoming.refusal``), naming this model and the
        sequence; ``reason``: its label in the refusals metric."""
        return refused(corr_id, f"{self.name}: {naming_sequence(corr_id, exc)}", exc, reason)

    def offered(self, load: ServerLoad, share: float = 1.0) -> float:
        """The demand offered to the server (``s3flow.serving.demand``): ``share`` of the busiest stage's
        utilization with the STARTs admitted and not yet held (1 / the admission instances: each publishes its
        share, a pod's summed), plus the price of the STARTs this instance refused for room lately. Safe beside
        :meth:`check` on another thread, given its own ``load`` (from a ``LoadBoard`` of its own)."""
        now, held = self.clock(), load.solver_ids
        pending = sum(1 for c, t in list(self._admitted.items()) if now - t <= self.grace_s and c not in held)
        return share * load.utilization(pending) + self.refused.total()

    def _note_refused(self, corr_id: int, load: ServerLoad, audio: Optional[bool]) -> None:
        """Count a START refused for room at one stream's share of the server when steady: one over its
        ensemble's capacity (token2wav's for a START that asks for audio), not at its start-up price (a fleet
        sized for the starts of streams that last would be too large); nothing before the server has priced its
        work."""
        capacity = load.wav_capacity if audio else load.capacity
        if load.known and capacity > 0:
            self.refused.note(corr_id, 1.0 / capacity)

    def _priced(self, load: ServerLoad, audio: Optional[bool]) -> ServerLoad:
        """The load once every solver instance (and for a START that asks for audio, every vocoder instance) has
        priced its work, or as it is after ``pricing_wait_s``."""
        deadline = time.monotonic() + self.pricing_wait_s
        while not load.known_for(audio) and time.monotonic() < deadline:
            time.sleep(PRICING_POLL_S)
            load = self.load.read()
        return load

    def _over_capacity(self, corr_id: int, req, load: ServerLoad, audio: Optional[bool]) -> Optional[Outcome]:
        """The capacity check (module docstring): None when the stream fits under the target."""
        held = load.solver_ids
        pending = sum(1 for c in self._admitted if c not in held and c != corr_id)   # admitted, not yet held
        if not held and not pending:   # an idle server takes a stream whatever its estimate: none is better served
            return None
        if not load.known_for(audio):   # a stream is held: the START waits for the instances' prices (bounded)
            load = self._priced(load, audio)
            held = load.solver_ids
            pending = sum(1 for c in self._admitted if c not in held and c != corr_id)
            if not held and not pending:
                return None
        if not load.known:   # never open wider than what the server knows: one stream at a time
            wait = 1.0
            return self._refuse(corr_id, ServerBusy(f"the server has not priced its work yet (its calibration at "
                                                    f"load); it takes one stream until it has; retry in {wait:.1f} "
                                                    f"s or on another server", wait), "capacity")
        stages = load.stages(req.n_timesteps, req.guidance_rate, pending, audio)
        target = self.target.utilization_target
        over = [s for s in stages if not s.fits(target)]
        if not over or (corr_id in held and all(s.now <= target for s in stages)):   # a restart replaces its id
            return None
        self._note_refused(corr_id, load, audio)
        waits = {s.name: load.wait_until(s, target, self.target.expected_utterance_s, pending, bool(audio))
                 for s in over}
        stage = max(over, key=lambda s: waits[s.name])
        wait = min(max(waits[stage.name], MIN_RETRY_S), MAX_RETRY_S)
        capacity = load.wav_capacity if audio else load.capacity
        stream = {None: "stream", True: "token2wav stream", False: "token2mel stream"}[audio]
        return self._refuse(corr_id, ServerBusy(f"the server is at capacity: the {stage.name}'s utilization "
                                                f"{stage.now:.2f} + {stage.need:.2f} for this {stream} is above the "
                                                f"target {target:.2f} (capacity {capacity:.1f} audio s per s); "
                                                f"retry in {wait:.1f} s or on another server", wait), "capacity")
