"""autotune check's decision rule, with a fake runner: noise-aware, regression only after every repeat."""

from __future__ import annotations

import pytest

from autotune.candidate import Candidate, Measurement, TrialError
from autotune.check import check_config
from autotune.model_file import load_model_file
from autotune.schedules import Schedule
from autotune.trial import TrialOptions
from autotune.tuned_config import TunedConfig
from tests.conftest import RECIPES

CANDIDATE = Candidate(schedule=Schedule.GPIPE, pipeline_degree=2, global_batch_size=32, n_microbatches=2,
                      layers_per_stage=(5, 5))


def config(recorded: float) -> TunedConfig:
    m = Measurement(candidate=CANDIDATE, status="ok", step_time_ms=32_000 / recorded,
                    throughput_samples_per_s=recorded, peak_memory_bytes=(10, 10))
    return TunedConfig.from_measurement(m, model=str(RECIPES / "mlp.py"), memory_limit_bytes=None, model_layers=10,
                                        model_sha256="0" * 16)


class Runner:
    def __init__(self, *throughputs, status="ok"):
        self.throughputs = list(throughputs)
        self.status = status
        self.calls = 0

    def __call__(self, spec, candidate, options):
        self.calls += 1
        if self.status != "ok":
            return Measurement(candidate=candidate, status=self.status,
                               error=TrialError(rank=1, kind=self.status, message="x", bytes_requested=123))
        t = self.throughputs.pop(0)
        return Measurement(candidate=candidate, status="ok", throughput_samples_per_s=t, step_time_ms=32_000 / t,
                           peak_memory_bytes=(10, 10))


@pytest.fixture(scope="module")
def spec():
    return load_model_file(RECIPES / "mlp.py")


def check(spec, runner, recorded=100.0):
    return check_config(config(recorded), spec, tolerance=0.1, repeats=3, options=TrialOptions(), runner=runner)


def test_within_tolerance_passes_after_one_run(spec):
    runner = Runner(95.0)
    result = check(spec, runner)
    assert result.status == "ok" and runner.calls == 1


def test_one_slow_run_is_repeated_and_the_median_decides(spec):
    runner = Runner(70.0, 98.0, 97.0)
    result = check(spec, runner)
    assert result.status == "ok" and runner.calls == 3 and result.measured_throughput_samples_per_s == 97.0


def test_regression_is_declared_only_after_every_repeat(spec):
    runner = Runner(50.0, 95.0, 52.0)
    result = check(spec, runner)
    assert result.status == "regressed" and runner.calls == 3
    assert "48% below the recorded" in result.message


def test_out_of_memory_and_failures(spec):
    assert check(spec, Runner(status="oom")).status == "oom"
    assert check(spec, Runner(status="error")).status == "failed"
