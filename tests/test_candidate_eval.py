"""Candidate vs shipped in ``scripts/evaluate_small.py`` (issue 43 part 3): the paired statistics against
closed forms, and two folders measured per sentence on the shipped held-out set (CPU, no tritonserver).

The measured part runs the function level of the script (``--no-served``'s path) on the two shortest held-out
sentences and two rows (the vocoder on the true mel; the 2-step student, vocoded), at the table's seeds and the
other seeds: a candidate folder equal to the shipped one gives differences of exactly 0 and "no difference"; a
folder holding only a perturbed vocoder takes its flow models from the shipped folder and is "candidate worse".
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from s3flow_training.evaluate import (BETTER, NO_DIFFERENCE, WORSE, PairedMetric, paired_from_json, paired_summary,
                                      paired_to_json, paired_verdict, t_interval)

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "checkpoints" / "trained"
ROWS = ("vocoder_true_mel", "student2_vocoder")


def import_script():
    spec = importlib.util.spec_from_file_location("_evaluate_small", ROOT / "scripts" / "evaluate_small.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module              # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------
# The statistics


def test_t_interval_matches_the_closed_form():
    lo, hi = t_interval(np.array([1.0, 2.0, 3.0]))
    half = 4.302652729911275 / math.sqrt(3)      # t(0.975, 2) sd / sqrt(n), sd = 1
    assert lo == pytest.approx(2 - half) and hi == pytest.approx(2 + half)
    assert t_interval(np.array([0.5, 0.5])) == (0.5, 0.5)
    assert all(math.isnan(v) for v in t_interval(np.array([1.0])))


@pytest.mark.parametrize("differences, reseeded, higher, verdict", [
    ([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], True, NO_DIFFERENCE),          # identical models
    ([0.10, 0.11, 0.12], [0.10, 0.12, 0.11], True, BETTER),
    ([0.10, 0.11, 0.12], [0.10, 0.12, 0.11], False, WORSE),           # an error that grew
    ([-0.10, -0.11, -0.12], [-0.10, -0.12, -0.11], False, BETTER),    # an error that fell
    ([0.10, 0.11, 0.12], [0.30, 0.31, 0.32], True, NO_DIFFERENCE),    # the seeds move it by more than it is
    ([0.10, -0.09, 0.02], [0.10, -0.09, 0.02], True, NO_DIFFERENCE),  # the interval holds 0
    ([0.10], [0.10], True, NO_DIFFERENCE),                             # one sentence: no interval
])
def test_verdict(differences, reseeded, higher, verdict):
    s = paired_summary(np.array(differences), np.array(reseeded), higher)
    assert s.mean_difference == pytest.approx(np.mean(differences))
    assert s.seed_spread == pytest.approx(abs(np.mean(reseeded) - np.mean(differences)))
    assert s.verdict == verdict


def test_verdict_needs_more_than_the_seed_spread():
    assert paired_verdict(0.05, (0.01, 0.09), 0.0499, True) == BETTER
    assert paired_verdict(0.05, (0.01, 0.09), 0.05, True) == NO_DIFFERENCE


def test_paired_metric_json_round_trip():
    m = PairedMetric("row", "ESTOI", True, (0.5, 0.6), (0.55, 0.62), (0.51, 0.59), (0.54, 0.63))
    got = paired_from_json(json.loads(json.dumps(paired_to_json([m]))))
    assert got == [m] and got[0].summary() == m.summary()
    with pytest.raises(ValueError, match="differ in length"):
        PairedMetric("row", "ESTOI", True, (0.5,), (0.5, 0.6), (0.5,), (0.5,))


# ---------------------------------------------------------------------------------------------------
# Two folders measured


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """{folder label: {reseed: {row key: Scores}}} for the shipped folder, an identical candidate and a
    candidate holding only a perturbed vocoder, on the two shortest held-out sentences."""
    from s3flow.model.vocoder import load_vocoder, write_vocoder_checkpoint
    from s3flow_training.package import load_heldout

    ev = import_script()
    torch.set_num_threads(2)
    utts = sorted(load_heldout(TRAINED / "heldout.npz"), key=lambda u: u.frames)[:2]
    perturbed = tmp_path_factory.mktemp("candidate")
    hift = load_vocoder(TRAINED / "vocoder.safetensors")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():                        # noise of half each tensor's spread on every weight
        for p in hift.parameters():
            if p.numel() > 1:
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=gen))
    write_vocoder_checkpoint(hift, perturbed / "vocoder.safetensors")
    folders = {"shipped": ev.load_models(ev.SHIPPED, TRAINED),
               "same": ev.load_models(ev.CANDIDATE, TRAINED, fallback=TRAINED),
               "perturbed": ev.load_models(ev.CANDIDATE, perturbed, fallback=TRAINED)}
    out = {label: {r: ev.measure_folder(models, utts, {}, reseed=r, keys=ROWS)[0] for r in (0, ev.RESEED)}
           for label, models in folders.items()}
    return ev, folders, out, utts


def pairs(ev, out, candidate):
    return ev.paired_metrics(out["shipped"][0], out[candidate][0], out["shipped"][ev.RESEED],
                             out[candidate][ev.RESEED])


def test_a_missing_file_comes_from_the_trained_folder(measured):
    ev, folders, _, _ = measured
    files = folders["perturbed"].files
    assert files["vocoder"].parent != TRAINED and files["vocoder"].name == "vocoder.safetensors"
    assert files["teacher"] == TRAINED / "teacher.safetensors" and files["student"] == TRAINED / "student.safetensors"
    with pytest.raises(FileNotFoundError, match="candidate folder not found"):
        ev.load_models(ev.CANDIDATE, TRAINED / "no_such_folder", fallback=TRAINED)


def test_the_other_seeds_change_the_audio(measured):
    """The seed spread measures something: the other seeds give other per-sentence scores."""
    _, _, out, _ = measured
    for key in ROWS:
        assert out["shipped"][0][key].estoi_each != out["shipped"][10_000][key].estoi_each, key
    assert out["shipped"][0]["student2_vocoder"].mel_each != out["shipped"][10_000]["student2_vocoder"].mel_each


def test_an_identical_candidate_differs_by_exactly_zero(measured):
    ev, _, out, utts = measured
    got = pairs(ev, out, "same")
    assert {(m.row, m.metric) for m in got} == {
        (ev.ROW[k].name, metric) for k in ROWS for metric, _, _ in ev.PAIRED_METRICS
        if not (k == "vocoder_true_mel" and metric == "mel error vs truth")}
    for m in got:
        assert len(m.shipped) == len(utts)
        assert np.all(m.differences == 0) and np.all(m.reseeded_differences == 0), (m.row, m.metric)
        s = m.summary()
        assert (s.mean_difference, s.seed_spread, s.verdict) == (0.0, 0.0, NO_DIFFERENCE)


def test_a_perturbed_vocoder_is_worse(measured, tmp_path):
    ev, folders, out, utts = measured
    got = {(m.row, m.metric): m for m in pairs(ev, out, "perturbed")}
    for key in ROWS:
        m = got[(ev.ROW[key].name, "ESTOI")]
        assert np.all(m.differences < 0), (key, m.differences)
        s = m.summary()
        assert s.interval[1] < 0 and abs(s.mean_difference) > s.seed_spread
        assert s.verdict == WORSE, (key, s)
    # the same student made the mel: its error is the shipped one exactly
    mel = got[(ev.ROW["student2_vocoder"].name, "mel error vs truth")]
    assert np.all(mel.differences == 0) and mel.summary().verdict == NO_DIFFERENCE

    # the report's section and the per-sentence file
    section = "\n".join(ev.paired_section([folders["shipped"], folders["perturbed"]], list(got.values()), len(utts),
                                          "x_paired.json"))
    assert "## Candidate vs shipped" in section and "taken from" in section
    line = next(s for s in section.splitlines() if s.startswith(f"| {ev.ROW['vocoder_true_mel'].name} | ESTOI |"))
    assert line.endswith(f"| {WORSE} |")
    path = tmp_path / "x_paired.json"
    ev.write_paired_json(path, [folders["shipped"], folders["perturbed"]], utts, list(got.values()))
    doc = json.loads(path.read_text())
    assert doc["folders"]["candidate"]["files"]["teacher"].endswith("checkpoints/trained/teacher.safetensors")
    assert [m.summary() for m in paired_from_json(doc["metrics"])] == [m.summary() for m in got.values()]


def test_the_in_process_stream_rows_run(measured):
    """The streamed-vs-offline rows each folder gets (prefix re-run mode): the served engine in process,
    close to offline synthesis of the same seed away from the seams."""
    from s3flow_training.evaluate import stream_vs_offline

    ev, folders, _, utts = measured
    got = stream_vs_offline(folders["shipped"].student, utts[:1], "student, 2 steps")
    assert got.seams > 0 and got.other_frames > got.seam_frames > 0
    assert got.mae_other < 0.06 and abs(got.mae_vs_gt_streamed - got.mae_vs_gt_offline) < 0.02
