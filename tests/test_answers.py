"""Answers as data (s3flow_contract.answers) and the client's reading of them (s3flow_client.resume.classify):
every disposition round-trips through the tag anywhere in a message, the last tag counts, Triton's own errors map
through one table, anything else is ``fail``; the client acts on the tag whatever the wording around it."""
import pytest

from s3flow_contract.answers import TRITON_ERRORS, Answer, Disposition, answer_of, read_tag, tagged
from s3flow_client.resume import classify


@pytest.mark.parametrize("answer", [Answer(Disposition.RETRY, 7), Answer(Disposition.BUSY, 12, retry_after_s=1.5),
                                    Answer(Disposition.RESUME, 3), Answer(Disposition.FAIL),
                                    Answer(Disposition.RETRY, 9, resend="prompt")])
def test_each_disposition_round_trips_through_its_tag_anywhere_in_a_message(answer):
    message = tagged("cfm_solver: sequence 7: something went wrong", answer)
    for wrapped in (message, f"in ensemble 'token2wav', {message}", f"{message} (and then some)"):
        assert read_tag(wrapped) == answer and answer_of(wrapped) == answer
        assert classify(wrapped) == answer


def test_the_last_tag_counts_when_a_message_quotes_a_member_s_answer():
    inner = tagged("estimator: RuntimeError: out of memory", Answer(Disposition.FAIL))
    outer = tagged(f"cfm_solver: sequence 4: model 'estimator' failed: {inner}; send it again",
                   Answer(Disposition.RETRY, 4))
    assert answer_of(outer) == Answer(Disposition.RETRY, 4)


def test_the_wording_does_not_matter_only_the_tag():
    """Words that the old client read as hints ("send it again", "draining", "retry in 2 s") decide nothing."""
    tag = Answer(Disposition.FAIL, 5).tag()
    for words in ("send it again", "the server is draining", "retry in 2 s", "is not active", "unavailable"):
        assert classify(f"sequence 5: {words} {tag}").disposition is Disposition.FAIL


@pytest.mark.parametrize("message, disposition, sequence", [
    ("inference request for sequence 1234 to model 'cfm_solver' must specify the START flag on the first "
     "request of the sequence", Disposition.RESUME, 1234),
    ("Server not ready", Disposition.RESUME, None),
    ("in ensemble 'token2mel', model 'cfm_solver' version 1 is not ready", Disposition.RESUME, None),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection refused",
     Disposition.RESUME, None),
    ("unexpected inference input 'foo' for model 'token2mel'", Disposition.FAIL, None),
    ("in ensemble 'token2mel', Stub process 'cfm_solver_0_0' is not healthy.", Disposition.RESUME, None),
])
def test_triton_s_own_errors_map_through_one_table(message, disposition, sequence):
    answer = answer_of(message)
    assert answer.disposition is disposition and answer.sequence == sequence
    assert all(p.pattern for p, _ in TRITON_ERRORS)


@pytest.mark.parametrize("message", ["[s3flow disposition=maybe sequence=3]", "[s3flow disposition=busy sequence=x]",
                                     "[s3flow]", "s3flow disposition=busy", "plain words"])
def test_a_message_without_a_valid_tag_is_a_failure_unless_triton_s_table_knows_it(message):
    assert read_tag(message) is None
    assert answer_of(message) == Answer(Disposition.FAIL)

