"""The one chunk pipeline (s3flow.model.chunks): lengths, condition and the pinned starting point."""
import numpy as np
import pytest
import torch

from s3flow_contract.tensors import LOOKAHEAD_FRAMES
from s3flow.model.chunks import NoisedMels, condition, solve_frames, stack_rows, starting_point
from s3flow.model.solver import FrameNoise


def test_solve_frames_trims_the_lookahead_only_when_not_finalised_and_never_below_the_prefix():
    token_len = torch.tensor([30, 30, 12])
    prefix = torch.tensor([20, 20, 20])
    assert solve_frames(token_len, prefix, True).tolist() == [60, 60, 24]
    assert solve_frames(token_len, prefix, False).tolist() == [60 - LOOKAHEAD_FRAMES, 54, 20]
    mixed = solve_frames(token_len, prefix, torch.tensor([True, False, False]))
    assert mixed.tolist() == [60, 54, 20]


def test_condition_puts_each_rows_prefix_in_cond_and_masks_from_the_lengths():
    g = torch.Generator().manual_seed(0)
    mu, spks = torch.randn(2, 4, 12, generator=g), torch.randn(2, 4, generator=g)
    prefixes = [torch.full((4, 3), 7.0), torch.full((4, 5), -2.0)]
    c = condition(mu, spks, torch.tensor([10, 8]), prefixes)
    assert c.mu.shape == c.cond.shape == (2, 4, 10) and c.mask.shape == (2, 1, 10)
    assert c.prefix_frames.tolist() == [3, 5] and c.generated.tolist() == [7, 3]
    assert torch.all(c.cond[0, :, :3] == 7) and torch.all(c.cond[0, :, 3:] == 0)
    assert torch.all(c.cond[1, :, :5] == -2) and torch.all(c.cond[1, :, 5:] == 0)
    assert c.mask[1, 0].tolist() == [1.0] * 8 + [0.0] * 2
    assert torch.equal(c.mu[1, :, :8], mu[1, :, :8]) and torch.all(c.mu[1, :, 8:] == 0)


def test_starting_point_pins_carried_frames_and_draws_fresh_noise_beyond():
    noise = FrameNoise(3, 4)
    prompt = noise.prompt(6)
    carried = NoisedMels(np.full((4, 10), 9.0, np.float32), start=2)      # frames [2, 12)
    z = starting_point(noise, prompt, 4, 20, carried)
    assert z.shape == (4, 6 + 16)
    np.testing.assert_array_equal(z[:, :6], prompt)
    assert np.all(z[:, 6:6 + 8] == 9.0)                                # frames [4, 12) pinned
    np.testing.assert_array_equal(z[:, 14:], noise.frames(12, 20))     # fresh after
    # without anything carried, it is the frame noise itself: offline and streamed start alike
    np.testing.assert_array_equal(starting_point(noise, prompt, 0, 30), noise.full(6, 30))


def test_starting_point_refuses_a_carried_block_that_starts_after_the_window():
    noise = FrameNoise(0, 4)
    with pytest.raises(ValueError, match="noised_mels start at frame 8, after the solve's first frame 4"):
        starting_point(noise, noise.prompt(2), 4, 10, NoisedMels(np.zeros((4, 3), np.float32), start=8))


def test_stack_rows_pads_at_the_end():
    out = stack_rows([np.ones((2, 3), np.float32), np.full((2, 5), 2.0, np.float32)], 5)
    assert out.shape == (2, 2, 5)
    assert out[0, :, 3:].abs().sum() == 0 and torch.all(out[1] == 2)
