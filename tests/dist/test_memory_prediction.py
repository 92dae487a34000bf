"""The simulator's peak memory against real 2-rank CPU trials (the tracker counts live tensor bytes exactly): the most
loaded rank within 5 %, and no rank under by more than 5 % (a small rank may be over by more: the boundary tensor
between two stages is counted on both sides, memory_model), for a schedule of each kind of memory behaviour: GPipe (all
micro-batches held), 1F1B (sends waited one by one), Interleaved 1F1B (several stages per rank, every send kept to
the end of the pipeline) and ZBV (split backward: an I keeps gradients for its W), on an MLP and a small GPT."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.candidate import Candidate
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
def profiles() -> dict[tuple[str, int], object]:
    return {}


@pytest.mark.dist
@pytest.mark.parametrize("model, batch, schedule, m, split", CASES, ids=[f"{c[2]}" for c in CASES])
def test_predicted_peak_within_5_percent_of_the_measured(profiles, model, batch, schedule, m, split):
    spec = load_model_file(ROOT / model)
    key = (model, batch)
    if key not in profiles:
        profiles[key] = profile_model(spec, batch_size=batch, repeats=1)
    candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=batch, n_microbatches=m,
                          layers_per_stage=split)
    measured = run_trial(spec, candidate, TrialOptions(steps=1, warmup=2, device="cpu"))
    assert measured.status == "ok", measured.error
    predicted = simulate(profiles[key], candidate, with_timeline=False).peak_memory_bytes
    errors = [(p - got) / got for p, got in zip(predicted, measured.peak_memory_bytes)]
    assert all(e >= -0.05 for e in errors), (candidate.key, predicted, measured.peak_memory_bytes, errors)
    most = max(measured.peak_memory_bytes)
    assert abs(max(predicted) - most) <= 0.05 * most, (candidate.key, predicted, measured.peak_memory_bytes)
