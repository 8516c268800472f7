"""What a client should do with an error answer, as data: the disposition of every error the servers send.

Every error the s3flow models answer carries one **tag** with a fixed grammar, anywhere in the message
(Triton's ensembles prefix a member's message with ``in ensemble '...',``, so it cannot sit at the head)::

    [s3flow disposition=busy sequence=7 retry_after_s=1.5]

The last tag in a message counts: the model that answers appends its own after the message, which may quote a
member model's answer with that one's tag inside. ``disposition`` is one of :class:`Disposition`; ``sequence`` the correlation id the error concerns (when the
server knows it); ``retry_after_s`` when to send again (``busy`` only); ``resend=prompt`` on a ``retry`` of a
START that named a voice this server does not hold: send the START again with the speaker prompt itself;
``resend=replay`` on a ``retry`` of a START whose resume snapshot this server cannot use: START again without
it and replay the answered chunks. Keys are ``[a-z_]+``, values have no
spaces or brackets; unknown keys are ignored, so the grammar can grow. Errors that Triton itself makes (a
sequence it dropped, a server that is not ready, a member model that is unavailable) carry no tag: they are
mapped to dispositions by one table, :data:`TRITON_ERRORS`. :func:`answer_of` reads either and is all a
client needs; any Triton client in any language can do the same with one regular expression.

=============  ==============================================================  ==============================
disposition    meaning                                                          what a client does
=============  ==============================================================  ==============================
``retry``      the chunk failed but the sequence is as before it (a model call  send the same chunk again to
               failed for a passing reason)                                      the same server
``busy``       the server cannot take a new sequence now (full)                 START again after
                                                                                ``retry_after_s``, here or on
                                                                                another server
``resume``     this server cannot go on with the utterance (it lost it, it is   replay the utterance on
               draining or not ready, the sequence was evicted)                  another server (or here once
                                                                                it is back)
``fail``       the request itself is wrong (or the server hit a bug): sending   give up on the utterance
               it again fails the same way
=============  ==============================================================  ==============================

Example::

    answer = answer_of("in ensemble 'token2mel', cfm_solver: sequence 7: too many live sequences "
                       "[s3flow disposition=busy sequence=7 retry_after_s=1.5]")
    answer.disposition is Disposition.BUSY and answer.retry_after_s == 1.5
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Optional


class Disposition(str, enum.Enum):
    RETRY = "retry"
    BUSY = "busy"
    RESUME = "resume"
    FAIL = "fail"


@dataclass(frozen=True)
class Answer:
    """The machine-readable part of an error answer."""
    disposition: Disposition
    sequence: Optional[int] = None
    retry_after_s: Optional[float] = None
    resend: Optional[str] = None          # "prompt": START with the prompt, not the voice id; "replay": no snapshot

    def tag(self) -> str:
        """The tag that goes into the message (module docstring)."""
        fields = [f"disposition={self.disposition.value}"]
        if self.sequence is not None:
            fields.append(f"sequence={int(self.sequence)}")
        if self.retry_after_s is not None:
            fields.append(f"retry_after_s={self.retry_after_s:.3g}")
        if self.resend is not None:
            fields.append(f"resend={self.resend}")
        return f"[s3flow {' '.join(fields)}]"


def tagged(message: str, answer: Answer) -> str:
    """``message`` with ``answer``'s tag at its end: the one way the servers state a disposition."""
    return f"{message} {answer.tag()}"


#: The tag anywhere in a message: ``[s3flow key=value ...]``.
TAG = re.compile(r"\[s3flow((?: [a-z_]+=[^\s\[\]]+)+)\]")


def read_tag(message: str) -> Optional[Answer]:
    """The last tag's answer, or None when the message has none (or its disposition is unknown)."""
    matches = list(TAG.finditer(message))
    if not matches:
        return None
    match = matches[-1]
    fields = dict(pair.split("=", 1) for pair in match.group(1).split())
    try:
        disposition = Disposition(fields.get("disposition", ""))
        sequence = int(fields["sequence"]) if "sequence" in fields else None
        retry = float(fields["retry_after_s"]) if "retry_after_s" in fields else None
    except ValueError:
        return None
    return Answer(disposition, sequence, retry, fields.get("resend"))


#: Triton's own errors (no tag), first match wins: (pattern, disposition). A pattern's group 1, when it has
#: one, is the sequence id. Seen from Triton 2.51 (the sequence batcher, the server's health, BLS and the
#: ensemble scheduler).
TRITON_ERRORS: tuple[tuple[re.Pattern, Disposition], ...] = (
    # the sequence batcher no longer knows the sequence (its idle window passed, or the server restarted)
    (re.compile(r"sequence (?:id )?(\d+) .*must specify the START flag", re.I), Disposition.RESUME),
    (re.compile(r"must specify the START flag", re.I), Disposition.RESUME),
    # the server is shutting down or not yet up, a model is not loaded or unavailable
    (re.compile(r"server (?:is )?not ready|Server not ready", re.I), Disposition.RESUME),
    (re.compile(r"model '[^']*' (?:version \d+ )?is not ready|unknown model|model not found|"
                r"is not available", re.I), Disposition.RESUME),
    (re.compile(r"\bunavailable\b|failed to connect|connection refused|socket closed|Deadline Exceeded",
                re.I), Disposition.RESUME),
    # a python model's stub process died (killed under the server): what it held is gone; the server reloads the
    # model (s3flow.server.healing), and the utterance goes on from its snapshot
    (re.compile(r"Stub process '[^']*' is not healthy", re.I), Disposition.RESUME),
)


def answer_of(message: str) -> Answer:
    """The disposition of an error message: its tag, else Triton's table, else ``fail``."""
    answer = read_tag(message)
    if answer is not None:
        return answer
    for pattern, disposition in TRITON_ERRORS:
        match = pattern.search(message)
        if match:
            sequence = int(match.group(1)) if match.groups() and match.group(1) else None
            return Answer(disposition, sequence)
    return Answer(Disposition.FAIL)
