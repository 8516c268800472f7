"""The client's event loop: utterances over gRPC streams to one or more servers, retried and resumed.

An utterance's output is a function of its tokens, prompt, seed, chunk boundaries and frame index only, so
when its server goes away it can be **resumed** on another one (or the same one after a restart). Every answer
of a bounded-context server carries the stream's snapshot (``s3flow.engine.snapshot`` on the server); the client
keeps the latest, and a resume STARTs again with the same prompt, seed and options *and that snapshot*, with the
chunk after it: one chunk of work whatever the stream's age. Without a snapshot (prefix mode, a server without
the fleet's key, ``snapshots=False``, or a server that refused it: ``resend=replay``) the resume sends the chunks
already answered again (same boundaries), then carries on. Frames that were delivered already are compared with
their replayed copies (they must agree within ``replay_tolerance``; a mismatch fails the utterance rather than
splicing two different syntheses) and not delivered twice. Every chunk carries its ``token_offset``, so a chunk
sent again after a retry is never applied twice.

What an error answer leads to is its disposition (``s3flow_contract.answers.answer_of``: the tag every s3flow
error carries, or the table of Triton's own errors; nothing here reads the wording):

=============  ==================================================================================
disposition    the client
=============  ==================================================================================
``retry``      sends the same chunk to the same server (with ``resend=prompt``: START again with the
               speaker prompt instead of the voice id, which this server does not hold; with
               ``resend=replay``: START again without the snapshot, replaying the answered chunks)
``busy``       START again on the next address, or here after ``retry_after_s``
``resume``     resumes the utterance on the next address
``fail``       fails that utterance only, and ENDs its sequence
(no sequence)  an error that names no sequence broke the stream: every utterance on it resumes elsewhere
=============  ==================================================================================

Retries and resumes are bounded (``max_retries``, ``max_resumes``, the deadline), logged (``s3flow_client``)
and kept in ``StreamResult.retries`` / ``.resumes``. A sequence given up or moved is ended with an empty END.
"""
from __future__ import annotations

import itertools
import logging
import queue
import time
from typing import Callable, Optional

import numpy as np
from tritonclient.utils import InferenceServerException

from s3flow_contract.answers import Answer, answer_of
from s3flow_contract.tensors import AUDIO_RESPONSE, STREAM_RESPONSE, request_arrays

from .channel import ServerStream
from .chunking import Situation
from .state import UtteranceState, new_corr_id

log = logging.getLogger("s3flow_client")
PROBE_S = 2.0                          # liveness probe of an address whose stream broke


def classify(message: str) -> Answer:
    """What to do about an error message: its disposition and the sequence it names (table above)."""
    return answer_of(message)


class Run:
    """One ``StreamingClient.synthesize`` call: the event loop over all utterances and connections."""

    def __init__(self, client, streams: list[UtteranceState], progress: Optional[Callable[[int], None]],
                 on_audio: Optional[Callable[[int, np.ndarray], None]], live: bool = False):
        """``live``: the loop keeps running for utterances opened later (``add``) until ``close``; tokens,
        ENDs and cancels arrive from other threads through the event queue (``s3flow_client.live``)."""
        self.c, self.streams, self.progress, self.on_audio = client, streams, progress, on_audio
        self.live, self.closed = live, False
        self.by_id = {s.corr_id: s for s in streams}
        self.retired: set[int] = set()                 # ids of attempts given up: their answers are ignored
        self.cleanups: set[str] = set()                # END requests of those, not yet answered
        self.conns: dict[int, ServerStream] = {}
        self.suspect: set[str] = set()                 # addresses whose stream broke
        self.events: queue.Queue = queue.Queue()
        self.due: list[tuple[float, UtteranceState]] = []  # sends scheduled for later (back-off)
        self.outputs = STREAM_RESPONSE + (AUDIO_RESPONSE if client.audio else ())
        self._ids = itertools.count()

    # -- connections ---------------------------------------------------------------------------------
    def conn_for(self, s: UtteranceState) -> ServerStream:
        url = self.c.urls[s.url_i]
        for conn in self.conns.values():
            if conn.alive and conn.url == url:
                return conn
        conn = ServerStream(next(self._ids), url, self.events, self.c.timeout_s, s.corr_id, self.c.channel)
        self.conns[conn.id] = conn
        return conn

    def broken(self, conn: ServerStream, why: str) -> None:
        """The stream to conn's server broke: every open utterance on it resumes elsewhere."""
        if not conn.alive:
            return
        conn.close()
        self.suspect.add(conn.url)
        for s in self.streams:
            if not s.done and s.conn is conn:
                self.resume(s, f"stream to {conn.url} broke: {why}")

    # -- sending ------------------------------------------------------------------------------------
    def answers(self, url: str) -> Optional[str]:
        """A server whose stream broke is asked whether it is live before a stream is opened to it again: a
        stream to an address that does not answer can take until its deadline to fail (gRPC's reconnect
        back-off), a liveness call fails within PROBE_S. Returns None if it answers live, else why not."""
        client = self.c.channel.connect(url)
        try:
            why = None if client.is_server_live(headers=self.c.channel.headers, client_timeout=PROBE_S) \
                else "it says it is not live"
        except InferenceServerException as exc:
            why = str(exc)
        finally:
            client.close()
        if why is None:
            self.suspect.discard(url)
        return why

    def send(self, s: UtteranceState) -> None:
        url = self.c.urls[s.url_i]
        why = self.answers(url) if url in self.suspect else None
        if why is not None:
            self.resume(s, f"the server at {url} does not answer: {why}")
            return
        i = s.next_chunk
        if i == len(s.sizes) and not self.choose_chunk(s):
            return  # live: waiting for tokens (or nothing to say at all)
        conn = s.conn = self.conn_for(s)
        s.sent_at = time.perf_counter()
        s.in_flight, s.recheck_at = True, None
        end = s.is_end(i)
        if end:
            s.end_chunk = i
        try:
            conn.send(self.c.model, s.tensors(), f"{s.corr_id}:{i}", s.corr_id, i == s.first_chunk, end,
                      self.outputs)
        except InferenceServerException as exc:  # the stream is gone; its cause comes through the callback
            self.broken(conn, self.cause(conn) or str(exc))

    def choose_chunk(self, s: UtteranceState) -> bool:
        """A live utterance's next chunk size (recorded in ``s.sizes``); False: nothing to send yet."""
        now, latency = time.perf_counter(), s.latencies[-1] if s.latencies else None
        d = s.chunker.decide(Situation(s.unsent, s.ended, len(s.sizes), s.lead_s(now, self.c.audio), latency,
                                       s.token_rate()))
        if d.size is None or (d.size == 0 and not s.ended):
            s.recheck_at = None if d.recheck_s is None else now + d.recheck_s
            return False
        if d.size == 0 and not s.sizes:   # ended before any token: no sequence to open
            s.done, s.wall = True, now - s.t0
            return False
        s.sizes.append(d.size)
        return True

    def cause(self, conn: ServerStream, wait_s: float = 0.5) -> Optional[str]:
        """The error that broke conn's stream, from the events (the others stay queued in order)."""
        kept, found, until = [], None, time.perf_counter() + wait_s
        while found is None and time.perf_counter() < until:
            try:
                event = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if event[0] == conn.id and event[1] is None and event[2] is not None:
                found = str(event[2])
            else:
                kept.append(event)
        for event in kept:
            self.events.put(event)
        return found

    def end_sequence(self, s: UtteranceState) -> None:
        """Give up this attempt's sequence: its answers are ignored; an empty END frees its server slot."""
        self.retired.add(s.corr_id)
        conn = s.conn
        if conn is None or not conn.alive or s.end_chunk is not None:
            return  # nothing was sent, the stream is gone, or the END itself was in flight
        rid = f"end:{s.corr_id}"
        try:
            conn.send(self.c.model, request_arrays([]), rid, s.corr_id, False, True,
                      self.outputs)
            self.cleanups.add(rid)
        except InferenceServerException:
            pass

    # -- outcomes -----------------------------------------------------------------------------------
    def fail(self, s: UtteranceState, message: str) -> None:
        s.error, s.done = message, True
        self.end_sequence(s)

    def resume(self, s: UtteranceState, why: str, delay: Optional[float] = None) -> None:
        """Start the utterance again as a new sequence on the next address: from its last snapshot, or replaying
        what was answered."""
        now = time.perf_counter()
        if len(s.resumes) >= self.c.max_resumes or now >= self.deadline:
            self.fail(s, f"{s.where()}: {why} (gave up after {len(s.resumes)} resumes)")
            return
        old_id, old_url = s.corr_id, self.c.urls[s.url_i]
        self.due = [d for d in self.due if d[1] is not s]
        self.end_sequence(s)
        self.new_attempt(s, (s.url_i + 1) % len(self.c.urls))
        url = self.c.urls[s.url_i]
        if delay is None:  # another server: at once; the same one: back off
            delay = 0.0 if url != old_url else self.c.retry_backoff_s * 2 ** len(s.resumes)
        how = (f"from the snapshot after chunk {s.first_chunk}" if s.first_chunk else
               f"replaying {s.answered} chunks")
        note = (f"sequence {old_id} on {old_url} at frame {s.frames}: {why} -> sequence {s.corr_id} on {url}"
                f" in {delay:.2f} s, {how}")
        s.resumes.append(note)
        log.warning("utterance %d: %s", s.index, note)
        self.due.append((now + delay, s))

    def new_attempt(self, s: UtteranceState, url_i: int) -> None:
        """The utterance goes on as a new sequence at address ``url_i``: from its last snapshot, or from the start
        (its answered chunks replayed)."""
        s.url_i, s.corr_id = url_i, new_corr_id()
        self.by_id[s.corr_id] = s
        s.start_attempt(from_snapshot=self.c.snapshots and s.use_snapshots)
        s.conn, s.in_flight, s.end_chunk = None, False, None

    def start_again_here(self, s: UtteranceState, message: str, how: str) -> None:
        """A START this server refused for what it carried: a new sequence on the same server, sent now."""
        s.retries.append(message)
        log.warning("utterance %d: %s: %s", s.index, message, how)
        self.end_sequence(s)
        self.new_attempt(s, s.url_i)
        self.due.append((time.perf_counter(), s))

    def on_error(self, conn: ServerStream, error) -> None:
        message = str(error)
        answer = classify(message)
        cid = answer.sequence
        if cid in self.retired:
            self.cleanups.discard(f"end:{cid}")
            return  # the answer to a sequence given up, or to its cleanup END
        s = self.by_id.get(cid) if cid is not None else None
        if s is None or s.done or s.corr_id != cid:
            self.broken(conn, message)  # tritonclient hands over stream errors without the request
            return
        kind = answer.disposition.value
        s.in_flight = False
        s.error_after = time.perf_counter() - s.sent_at
        if answer.resend == "replay" and s.first_chunk:
            s.use_snapshots = False   # this server cannot go on from the snapshot: START again and replay
            self.start_again_here(s, message, "replaying instead")
            return
        if answer.resend == "prompt" and s.by_voice_id and s.utt.prompt_tokens is not None:
            s.by_voice_id = False   # this server does not hold the voice: START again with the prompt itself
            self.start_again_here(s, message, "sending the prompt instead")
            return
        if kind in ("retry", "busy") and len(s.retries) < self.c.max_retries:
            s.retries.append(message)
            log.warning("utterance %d: %s: %s", s.index, kind, message)
            if kind == "busy" and len(self.c.urls) > 1 and s.answered == 0:
                self.resume(s, message, delay=0.0)   # a full server: try the next one now
                return
            wait = self.c.retry_backoff_s * 2 ** (len(s.retries) - 1)
            if kind == "busy" and answer.retry_after_s is not None:
                wait = answer.retry_after_s
            self.due.append((time.perf_counter() + wait, s))
        elif kind in ("resume", "busy"):
            self.resume(s, message)
        else:
            self.fail(s, f"{s.where()}: {message}")

    def on_result(self, result, now: float) -> None:
        rid = result.get_response().id
        if rid.startswith("end:"):
            self.cleanups.discard(rid)
            return
        cid, i = (int(x) for x in rid.split(":"))
        s = self.by_id.get(cid)
        if s is None or s.done or cid != s.corr_id:
            return  # an answer for an attempt given up
        fresh = i >= s.answered  # a chunk never answered before, not a replayed one
        s.in_flight = False
        if result.as_numpy("mel") is None or result.as_numpy("frame_offset") is None:
            self.resume(s, f"the server answered chunk {i} without its mel")   # its state there is in doubt
            return
        try:
            frame_at, sample_at = s.frames, s.samples
            mel = s.accept(result.as_numpy("mel")[0], int(result.as_numpy("frame_offset").reshape(-1)[0]), fresh)
            audio = None
            if self.c.audio:
                audio = s.accept_audio(result.as_numpy("audio").reshape(-1),
                                       int(result.as_numpy("sample_offset").reshape(-1)[0]), now, fresh)
                if self.on_audio and audio.size:
                    self.on_audio(s.index, audio)
            if s.sink is not None and (mel.shape[1] or (audio is not None and audio.size)):
                s.sink(mel, frame_at, audio, sample_at)
        except ValueError as exc:
            self.fail(s, str(exc))
            return
        s.keep_snapshot(result.as_numpy("snapshot"), i)
        if fresh:
            s.keep_steps(result.as_numpy("steps"), i)
            if i == 0:   # the START that was admitted went out this long after the utterance began
                s.admitted_after = s.sent_at - s.t0
            s.latencies.append(now - s.sent_at)
            s.answered = i + 1
            if self.progress:
                self.progress(1)
        ended = i == s.end_chunk   # (a live END may have come after this chunk was sent without it)
        s.next_chunk += 1
        if ended:
            s.done, s.wall = True, now - s.t0
        else:
            self.send(s)   # a live one may wait for tokens here

    # -- live control (events put by other threads: conn_id None) -------------------------------------
    def control(self, kind: str, s: Optional[UtteranceState], arg=None) -> None:
        now = time.perf_counter()
        if kind == "open":
            s.t0 = now
            self.streams.append(s)
            self.by_id[s.corr_id] = s
            self.send(s)
        elif kind == "close":   # utterances ended finish; those never ended cannot, and fail now
            self.closed = True
            for t in self.streams:
                if not t.done and not t.ended:
                    self.fail(t, f"{t.where()}: the client closed before end()")
        elif s.done:
            return
        elif kind == "push":
            if s.ended:   # (LiveStream refuses a push after end() in the caller's thread already)
                self.fail(s, f"{s.where()}: push after end()")
                return
            s.push(arg, now)
            self.nudge(s)
        elif kind == "end":
            s.finish()
            self.nudge(s)
        elif kind == "cancel":
            self.fail(s, f"{s.where()}: cancelled by the client")

    def nudge(self, s: UtteranceState) -> None:
        """A live utterance with nothing in flight and nothing due may have a chunk to send now."""
        if not s.done and not s.in_flight and not any(d[1] is s for d in self.due):
            self.send(s)

    def busy(self) -> bool:   # an utterance not done, or (live) the client still open
        return (self.live and not self.closed) or any(not s.done for s in self.streams)

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        start = time.perf_counter()
        self.deadline = start + self.c.timeout_s if self.c.timeout_s is not None else float("inf")
        last_event = start
        for s in self.streams:
            s.t0 = start
            self.send(s)
        try:
            while self.busy():
                now = time.perf_counter()
                for item in [d for d in self.due if d[0] <= now]:
                    self.due.remove(item)
                    if not item[1].done:
                        self.send(item[1])
                for s in [s for s in self.streams if s.recheck_at is not None and s.recheck_at <= now]:
                    s.recheck_at = None
                    self.nudge(s)
                self.notify_done()
                if not self.busy():
                    break  # the sends above may have settled the last utterances (given up)
                waiting = any(s.in_flight for s in self.streams if not s.done)
                wait = self.deadline - now
                if self.c.response_timeout_s is not None and not self.due and waiting:
                    wait = min(wait, last_event + self.c.response_timeout_s - now)
                if self.due:
                    wait = min(wait, min(d[0] for d in self.due) - now)
                rechecks = [s.recheck_at for s in self.streams if s.recheck_at is not None and not s.done]
                if rechecks:
                    wait = min(wait, min(rechecks) - now)
                try:
                    conn_id, result, error = self.events.get(timeout=min(max(wait, 0.01), 3600.0))
                except queue.Empty:
                    if (self.due or rechecks or not waiting) and time.perf_counter() < self.deadline:
                        continue  # a retry or a chunking decision is due, or nothing awaits an answer
                    self.timed_out(time.perf_counter() >= self.deadline)
                    break
                if conn_id is None:   # live control from another thread
                    self.control(result, error[0], error[1])
                    last_event = time.perf_counter() if result in ("push", "end", "open") else last_event
                    continue
                conn = self.conns[conn_id]
                if not conn.alive:
                    continue  # a stream given up: its utterances moved on
                now = last_event = time.perf_counter()
                if result is None or error is not None:
                    self.on_error(conn, error)
                else:
                    self.on_result(result, now)
            self.wait_cleanups()
        finally:
            for conn in self.conns.values():
                if conn.alive:   # gracefully where nothing on it awaits an answer (ServerStream.close)
                    conn.close(graceful=not self.cleanups and not any(
                        s.in_flight and s.conn is conn for s in self.streams))
            for s in self.streams:
                if not s.done:
                    s.error, s.done = s.error or f"{s.where()}: the client closed", True
            self.notify_done()

    def notify_done(self) -> None:   # a None delivery tells a live sink its utterance finished
        for s in self.streams:
            if s.done and s.sink is not None:
                sink, s.sink = s.sink, None
                sink(None, s.frames, None, s.samples)

    def timed_out(self, overall: bool) -> None:
        bound = (f"{self.c.timeout_s} s in all" if overall else f"{self.c.response_timeout_s} s since the last one")
        for s in self.streams:
            if not s.done:
                self.fail(s, f"{s.where()}: no response within {bound}")

    def wait_cleanups(self, bound_s: float = 2.0) -> None:
        """Let the END requests of given-up sequences reach their servers before the streams close."""
        until = time.perf_counter() + bound_s
        while self.cleanups and time.perf_counter() < until:
            try:
                conn_id, result, error = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if conn_id is None:
                continue  # live control after the loop ended: nothing left to act on
            if result is not None:
                self.cleanups.discard(result.get_response().id)
                continue
            cid = classify(str(error)).sequence
            if cid not in self.retired:
                break  # the stream itself broke: nothing more will come
            self.cleanups.discard(f"end:{cid}")
