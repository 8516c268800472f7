"""Issue 50's count (``s3flow_tools.measure.stream_work``): the frames a streamed utterance makes each Euler step
solve, from the engine's own plan, against one request; and what the schemes that keep the prompt's (and the
context's) keys and values would solve."""
from __future__ import annotations

from s3flow.engine.settings import ChunkSolving
from s3flow.model.estimator import EstimatorConfig
from s3flow_tools.measure.stream_work import count, scheme_calls, windows


def test_a_5_s_stream_with_a_10_s_prompt_solves_its_capped_prompt_and_context_again_every_chunk():
    ws = windows(250, [10, 20, 40, 55], context_frames=100, prompt_frames=50)
    assert [w.frames for w in ws] == [64, 104, 184, 266]
    assert [w.prompt for w in ws] == [50] * 4 and [w.context for w in ws] == [0, 14, 54, 100]
    assert [w.new for w in ws] == [14, 40, 80, 116], "each frame is new once: the held-back 6 with the next chunk"
    assert sum(w.new for w in ws) == 2 * 125, "every frame of the utterance is solved new exactly once"


def test_the_schemes_solve_less_and_one_that_keeps_prompt_and_context_solves_each_frame_once():
    solving = ChunkSolving()
    today = scheme_calls("today", 250, [10, 20, 40, 55], solving)
    kept = scheme_calls("prompt kept", 250, [10, 20, 40, 55], solving)
    once = scheme_calls("each frame once", 250, [10, 20, 40, 55], solving)
    assert sum(q for q, _ in today) == 618 and sum(q for q, _ in kept) == 468
    assert sum(q for q, _ in once) == 50 + 250, "one prompt pass and every frame once: one request's frames"
    assert all(k >= q for q, k in kept + once), "a query never attends to fewer keys than itself"
    c = count(10, 5, solving, EstimatorConfig.full())
    assert abs(c["today"]["queries"] / c["one request"]["queries"] - 618 / 300) < 1e-9
    assert c["each frame once"]["gflop"] < c["prompt kept"]["gflop"] < c["today"]["gflop"]
