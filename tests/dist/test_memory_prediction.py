"""The simulator's peak memory against real 2-rank CPU trials (the tracker counts live tensor bytes exactly): the most
loaded rank within 5 %, and no rank under by more than 5 % (a small rank may be over by more: the boundary tensor
between two stages is counted on both sides, memory_model), for a schedule of each kind of memory behaviour: GPipe (all
micro-batches held), 1F1B (sends waited one by one), Interleaved 1F1B (several stages per rank, every send kept to
the end of the pipeline) and ZBV (split backward: an I keeps gradients for its W), on an MLP and a small GPT.
ZBV's most loaded rank is over by ~12 % (the safe direction), marked as an expected failure until the profile
measures what a layer's I keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.candidate import Candidate
from autotune.costs import Profile
from autotune.model_file import load_model_file
from autotune.profiling import profile_model
from autotune.schedules import Schedule
from autotune.simulate import simulate
from autotune.trial import TrialOptions, run_trial

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    ("recipes/mlp.py", 64, Schedule.GPIPE, 4, (5, 5)),
    ("recipes/mlp.py", 64, Schedule.ONE_F_ONE_B, 4, (3, 7)),
    ("recipes/gpt.py", 32, Schedule.INTERLEAVED_1F1B, 4, (2, 2, 2, 2)),
    ("recipes/gpt.py", 32, Schedule.ZBV_ZERO_BUBBLE, 4, (1, 2, 2, 3)),
]


@pytest.fixture(scope="module")
def peaks() -> dict[Schedule, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per case: (predicted, measured) peak bytes per rank."""
    profiles: dict[tuple[str, int], Profile] = {}
    result = {}
    for model, batch, schedule, m, split in CASES:
        spec = load_model_file(ROOT / model)
        if (model, batch) not in profiles:
            profiles[(model, batch)] = profile_model(spec, batch_size=batch, repeats=1)
        candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=batch, n_microbatches=m,
                              layers_per_stage=split)
        measured = run_trial(spec, candidate, TrialOptions(steps=1, warmup=2, device="cpu"))
        assert measured.status == "ok", measured.error
        predicted = simulate(profiles[(model, batch)], candidate, with_timeline=False).peak_memory_bytes
        result[schedule] = (predicted, measured.peak_memory_bytes)
    return result


@pytest.mark.dist
@pytest.mark.parametrize("schedule", [c[2] for c in CASES])
def test_no_rank_is_under_predicted_by_more_than_5_percent(peaks, schedule):
    predicted, measured = peaks[schedule]
    assert all(p >= 0.95 * got for p, got in zip(predicted, measured)), (predicted, measured)


@pytest.mark.dist
@pytest.mark.parametrize("schedule", [
    *[c[2] for c in CASES if c[2] != Schedule.ZBV_ZERO_BUBBLE],
    pytest.param(Schedule.ZBV_ZERO_BUBBLE, marks=pytest.mark.xfail(strict=True, reason=(
        "over by ~12 %: the gradients an I keeps for its W are estimated per layer from the saved activations "
        "(memory_model.split_kept_bytes), about 20 % more than attention's on recipes/gpt.py"))),
])
def test_the_most_loaded_rank_within_5_percent(peaks, schedule):
    predicted, measured = peaks[schedule]
    assert abs(max(predicted) - max(measured)) <= 0.05 * max(measured), (predicted, measured)
