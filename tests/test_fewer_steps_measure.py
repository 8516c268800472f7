"""The fewer-steps quality driver's own arithmetic (``s3flow_tools.measure.fewer_steps``): its seam measure and its
rows (the driver itself runs the trained model: results/fewer_steps.md)."""
import numpy as np

from s3flow_tools.measure.fewer_steps import FULL, rows, seam_ratio


def test_a_seam_is_measured_against_the_frames_within_chunks():
    ramp = np.tile(np.arange(40, dtype=np.float32), (80, 1))      # every frame 1 above the last
    assert seam_ratio(ramp, [10, 25]) == 1.0, "a boundary like any other frame"
    jump = ramp.copy()
    jump[:, 25:] += 3.0                                           # a step of 4 where chunk 3 begins
    assert abs(seam_ratio(jump, [10, 25]) - 2.5) < 1e-6, "(1 + 4) / 2 at the seams over 1 within"
    assert np.isnan(seam_ratio(ramp, [])), "one chunk: no seam to measure"


def test_the_rows_name_each_chunks_steps():
    table = dict(rows())
    assert [table["every chunk at 6"](i) for i in range(3)] == [6, 6, 6]
    assert [table["the START at 4, the rest at 10"](i) for i in range(3)] == [4, FULL, FULL]
    assert [table["every other chunk at 4 (from the second)"](i) for i in range(4)] == [FULL, 4, FULL, 4]
