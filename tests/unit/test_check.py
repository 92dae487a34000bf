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


def config_with_runs(*runs: float) -> TunedConfig:
    import statistics

    median = statistics.median(runs)
    m = Measurement(candidate=CANDIDATE, status="ok", step_time_ms=32_000 / median,
                    throughput_samples_per_s=median, peak_memory_bytes=(10, 10))
    return TunedConfig.from_measurement(m, model=str(RECIPES / "mlp.py"), memory_limit_bytes=None, model_layers=10,
                                        model_sha256="0" * 16, runs_step_time_ms=tuple(32_000 / t for t in runs))


def test_a_config_recorded_at_the_top_of_its_spread_is_judged_against_its_noise(spec):
    # The search ran the winner 3 times, 356-399 samples/s (median 380); a check at 345 is 9 % under the median but
    # within 5 % of the slowest recorded run: noise, not a regression.
    tuned = config_with_runs(380.0, 356.0, 399.0)
    assert tuned.measured.runs_throughput_samples_per_s == pytest.approx((380.0, 356.0, 399.0))
    result = check_config(tuned, spec, tolerance=0.05, repeats=3, options=TrialOptions(), runner=Runner(345.0))
    assert result.status == "ok" and result.floor_samples_per_s == pytest.approx(356.0 * 0.95)
    assert "356.0" in result.message
    slow = check_config(tuned, spec, tolerance=0.05, repeats=3, options=TrialOptions(),
                        runner=Runner(300.0, 320.0, 310.0))
    assert slow.status == "regressed"
    assert not slow.message.startswith("regressed")  # the CLI prints "regressed: <message>"
    assert "under the 338.2 a pass needs" in slow.message


def test_the_recorded_runs_survive_the_file(tmp_path):
    from autotune.config_file import load_config, save_config

    path = save_config(config_with_runs(380.0, 356.0, 399.0), tmp_path / "c.yaml")
    assert load_config(path).measured.runs_throughput_samples_per_s == pytest.approx((380.0, 356.0, 399.0))
    old = save_config(config(100.0), tmp_path / "old.yaml")  # not recorded: the key is left out, and loads
    assert "runs_throughput" not in old.read_text()
    assert load_config(old).measured.runs_throughput_samples_per_s == ()


def test_a_layer_whose_width_changed_no_longer_matches(tmp_path):
    from autotune.check import resolve_model
    from autotune.errors import ConfigError
    from autotune.model_file import fingerprint

    model = tmp_path / "mlp.py"
    model.write_text((RECIPES / "mlp.py").read_text())
    spec = load_model_file(model)
    m = Measurement(candidate=CANDIDATE, status="ok", step_time_ms=10.0, throughput_samples_per_s=3200.0,
                    peak_memory_bytes=(10, 10))
    tuned = TunedConfig.from_measurement(m, model=str(model), memory_limit_bytes=None, model_layers=10,
                                         model_sha256=fingerprint(model),
                                         layer_parameter_bytes=tuple(spec.parameter_bytes))
    config_path = tmp_path / "tuned.yaml"
    assert resolve_model(tuned, config_path, None).n_layers == 10
    model.write_text(model.read_text() + "\n# a comment: same layers\n")
    assert resolve_model(tuned, config_path, None).n_layers == 10  # edited, same shapes: still applies
    model.write_text(model.read_text().replace("WIDTHS = [512, 1024,", "WIDTHS = [512, 2048,"))
    with pytest.raises(ConfigError, match=r"layer 1 \(Sequential\) of .* holds 4\.0 MiB of parameters, 2\.0 MiB"):
        resolve_model(tuned, config_path, None)
    old = TunedConfig.from_measurement(m, model=str(model), memory_limit_bytes=None, model_layers=10,
                                       model_sha256="0" * 16)
    with pytest.raises(ConfigError, match="is not the file the config was tuned on"):
        resolve_model(old, config_path, None)
