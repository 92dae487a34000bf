"""bench/calibrate.py's own arithmetic: the profiles' median, the measurements' noise floor and the profiles'."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import calibrate  # noqa: E402


def test_profiles_taken_at_several_moments_merge_by_their_median() -> None:
    fast = {"optimizer_step_ms": 2.1, "parameter_bytes": 100, "layers": [{"forward_ms": [1.0, 2.0], "name": "a"}]}
    slow = {"optimizer_step_ms": 3.7, "parameter_bytes": 100, "layers": [{"forward_ms": [1.2, 2.4], "name": "a"}]}
    again = {"optimizer_step_ms": 2.3, "parameter_bytes": 100, "layers": [{"forward_ms": [0.9, 2.2], "name": "a"}]}

    merged = calibrate.median_profile([slow, fast, again])

    assert merged["optimizer_step_ms"] == 2.3  # the slow moment's 3.7 does not carry
    assert merged["parameter_bytes"] == 100
    assert merged["layers"] == [{"forward_ms": [1.0, 2.2], "name": "a"}]


def test_the_merged_host_probe_is_the_lowest_of_the_profiles() -> None:
    probes = [{"host_call_ms": 0.0839, "optimizer_step_ms": 4.0}, {"host_call_ms": 0.0924, "optimizer_step_ms": 5.0},
              {"host_call_ms": 0.0640, "optimizer_step_ms": 6.0}]

    merged = calibrate.median_profile(probes)

    assert merged["host_call_ms"] == 0.0640  # the median would be 0.0839
    assert merged["optimizer_step_ms"] == 5.0  # everything else stays the median


def test_the_profile_floor_predicts_from_each_profile_alone() -> None:
    from autotune.candidate import Candidate
    from autotune.costs import LayerCost, Profile
    from autotune.schedules import Schedule
    from autotune.simulate import simulate

    def profile(ms: float) -> dict:
        layer = LayerCost(forward_ms=ms, backward_input_ms=2 * ms, backward_weight_ms=0.0, saved_bytes=1024,
                          output_bytes=1024, parameter_bytes=4096)
        return Profile.from_layer_costs([layer, layer], input_bytes=64, optimizer_step_ms=0.1).to_dict()
    candidate = Candidate(schedule=Schedule.GPIPE, pipeline_degree=2, global_batch_size=2, n_microbatches=2,
                          layers_per_stage=(1, 1))
    fast, slow = profile(1.0), profile(2.0)
    measured = simulate(Profile.from_dict(fast), candidate, with_timeline=False).step_time_ms
    rows = [{"candidate_dict": candidate.to_dict(), "measured_ms": measured}]

    floor = calibrate.profile_floor(rows, [fast, slow])

    assert floor is not None
    assert floor["each_mape"][0] == 0.0 < floor["each_mape"][1]
    assert floor["between"] > 0.2  # twice the compute: predictions far apart
    assert calibrate.profile_floor(rows, [fast, fast])["between"] == 0.0
    assert calibrate.profile_floor(rows, [fast]) is None
    assert calibrate.profile_floor_text({"profile_floor": floor}).endswith(")")


def test_profiles_of_different_shapes_keep_the_first() -> None:
    first = {"micro_batch_sizes": [1, 2, 4], "x": 1.0}
    second = {"micro_batch_sizes": [1, 2], "x": 3.0}

    merged = calibrate.median_profile([first, second])

    assert merged["micro_batch_sizes"] == [1, 2, 4]
    assert merged["x"] == 1.0  # median_low of two


def test_the_noise_floor_is_what_the_passes_say_of_themselves() -> None:
    steady = [{"candidate": f"GPipe/m{m}/[1-1]", "runs_ms": [10.0] * 5} for m in (1, 2, 4)]
    bimodal = [{"candidate": "VHalf/m4/[1-1-1-1]", "runs_ms": [16.8, 16.0, 15.2, 9.9, 10.3]},
               {"candidate": "VHalf/m8/[1-1-1-1]", "runs_ms": [30.0, 18.0, 29.0, 17.5, 29.5]}]

    assert calibrate.noise_floor(steady) == {"mape": 0.0, "worst_family": 0.0, "meets": 1.0}
    floor = calibrate.noise_floor(steady + bimodal)
    assert floor is not None and floor["worst_family"] > 0.0 and floor["meets"] < 1.0
    assert calibrate.noise_floor([{"candidate": "GPipe/m1/[1-1]", "runs_ms": [10.0, 11.0]}]) is None


def test_the_hosts_steadiness_is_timed_in_windows_and_reported_as_their_spread() -> None:
    import rank_threads

    spread = rank_threads.host_spread(seconds=1.0, window_s=0.25)

    assert len(spread["windows_ms"]) >= 3
    assert 0 < spread["lowest_ms"] <= spread["median_ms"] <= spread["highest_ms"]
    assert spread["spread"] == spread["highest_ms"] / spread["lowest_ms"] >= 1.0
    table = rank_threads.spread_table({"before": spread})
    assert table.splitlines()[2].startswith("| before |")


def test_the_host_scale_is_the_passes_readings_over_the_profiles() -> None:
    assert calibrate.host_scaled({"profiles": [1.2, 1.0, 1.1], "passes": [1.65, 1.6, 1.7, 1.5]}) == 1.625 / 1.1
    assert calibrate.host_scaled({"profiles": [1.0], "passes": []}) is None
    assert calibrate.host_scaled({}) is None
    text = calibrate.host_scaled_text({"signed_error": -0.12, "mape_host_scaled": 0.05, "host_scale": 1.48})
    assert text == "-12.0%; 5.0% (x1.48)"
    assert calibrate.host_scaled_text({"signed_error": 0.03, "mape_host_scaled": None}) == "+3.0%"
