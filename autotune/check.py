"""Re-verify a tuned config: does it still match the model, still fit the memory limit, still run as fast as recorded?

Noise-aware: the config records every run the search took of it (its leaders are re-run side by side), and a check
passes while its median stays within the tolerance of the slowest of those, the run-to-run noise the search itself
saw. One run that passes ends the check; a slower one is repeated, and only the median of all runs decides a
regression, so a single unlucky run on a busy machine does not fail a CI job. A model file whose layers changed
(count, or a layer's parameter bytes) no longer matches the config: exit 2, not a "regression".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from autotune.candidate import Measurement
from autotune.errors import ConfigError, InvalidCandidateError
from autotune.model_file import ModelSpec, check_model, fingerprint, load_model_file
from autotune.trial import TrialOptions, TrialRunner, run_trial
from autotune.tuned_config import TunedConfig
from autotune.units import format_bytes

CheckStatus = Literal["ok", "regressed", "oom", "failed"]


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    status: CheckStatus
    """ok: fits and within tolerance; regressed: slower than recorded; oom: no longer fits; failed: error/timeout."""
    message: str
    recorded_throughput_samples_per_s: float
    measured_throughput_samples_per_s: float | None
    """Median over the runs that finished."""
    ratio: float | None
    """measured / recorded."""
    tolerance: float
    floor_samples_per_s: float = 0.0
    """The slowest median throughput that passes: the slowest recorded run (else the recorded median) less the
    tolerance."""
    runs: tuple[Measurement, ...] = field(default_factory=tuple)
    memory_limit_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        last = self.runs[-1] if self.runs else None
        return {
            "status": self.status,
            "message": self.message,
            "recorded_throughput_samples_per_s": self.recorded_throughput_samples_per_s,
            "measured_throughput_samples_per_s": self.measured_throughput_samples_per_s,
            "ratio": self.ratio,
            "tolerance": self.tolerance,
            "floor_samples_per_s": self.floor_samples_per_s,
            "runs": [m.throughput_samples_per_s for m in self.runs],
            "peak_memory_bytes": list(last.peak_memory_bytes) if last else [],
            "memory_limit_bytes": self.memory_limit_bytes,
            "error": None if last is None or last.error is None else last.error.message,
        }


def resolve_model(config: TunedConfig, config_path: Path, model: Path | None) -> ModelSpec:
    """The model the config is for (--model, else the config's path as written or next to the config), checked
    against what the config recorded: a changed layer count means the config no longer applies."""
    if model is None:
        written = Path(config.model)
        candidates = [written, config_path.parent / written] if not written.is_absolute() else [written]
        model = next((p for p in candidates if p.exists()), written)
    spec = load_model_file(model, split_at=config.split_at)
    if spec.n_layers != config.model_layers:
        raise ConfigError(
            f"{config_path}: the config is for a model of {config.model_layers} layers but {model} has "
            f"{spec.n_layers}; the model changed: run autotune search again to write a new config"
        )
    _check_unchanged(config, config_path, Path(model), spec)
    try:
        config.candidate.validate(spec.n_layers)
    except InvalidCandidateError as exc:
        raise ConfigError(f"{config_path}: {exc}") from None
    check_model(spec, config.global_batch_size)
    return spec


def _check_unchanged(config: TunedConfig, config_path: Path, model: Path, spec: ModelSpec) -> None:
    """An edited model file still matches when every layer holds the parameter bytes it held when tuned (a comment
    or a training detail changed); a layer that grew or shrank means the config no longer applies."""
    if fingerprint(spec.path) == config.model_sha256:
        return
    again = "the model changed: run autotune search again to write a new config"
    recorded = config.layer_parameter_bytes
    if recorded is None:
        raise ConfigError(
            f"{config_path}: {model} is not the file the config was tuned on (model_sha256 {config.model_sha256}, "
            f"now {fingerprint(spec.path)}) and the config does not record its layers' sizes to compare; {again}"
        )
    for i, (then, now) in enumerate(zip(recorded, spec.parameter_bytes)):
        if then != now:
            raise ConfigError(
                f"{config_path}: layer {i} ({spec.layer_names[i]}) of {model} holds {format_bytes(now)} of "
                f"parameters, {format_bytes(then)} when the config was tuned; {again}"
            )


def config_device(config: TunedConfig, choice: Any = None) -> str:
    """The device to check on: the one asked for (auto, cpu, cuda), else the one the config was measured on, so that
    `autotune check CONFIG` as the config's header prints it works on the machine that tuned it."""
    if choice is not None:
        return str(getattr(choice, "value", choice))
    return "cpu" if config.environment.device.startswith("cpu") else "cuda"


def check_config(
    config: TunedConfig,
    spec: ModelSpec,
    *,
    tolerance: float = 0.05,
    repeats: int = 3,
    options: TrialOptions,
    runner: TrialRunner = run_trial,
) -> CheckResult:
    recorded = config.measured.throughput_samples_per_s
    recorded_runs = config.measured.runs_throughput_samples_per_s
    floor = (min(recorded_runs) if recorded_runs else recorded) * (1 - tolerance)
    noise = (
        f"the slowest of the search's {len(recorded_runs)} runs of it ({min(recorded_runs):.1f}) less {tolerance:.0%}"
        if len(recorded_runs) > 1
        else f"the recorded {recorded:.1f} less {tolerance:.0%}"
    )
    runs: list[Measurement] = []
    while len(runs) < max(1, repeats):
        m = runner(spec, config.candidate, options)
        runs.append(m)
        if m.status == "oom":
            peak = f" ({format_bytes(m.error.bytes_requested)} asked)" if m.error and m.error.bytes_requested else ""
            return CheckResult(
                status="oom", runs=tuple(runs), tolerance=tolerance, recorded_throughput_samples_per_s=recorded,
                measured_throughput_samples_per_s=None, ratio=None, memory_limit_bytes=options.memory_limit_bytes,
                message=f"the config no longer fits the memory limit of {format_bytes(options.memory_limit_bytes)}"
                f"{peak} on rank {m.error.rank if m.error else '?'}: run autotune search again, or raise the limit",
            )
        if m.status != "ok":
            return CheckResult(
                status="failed", runs=tuple(runs), tolerance=tolerance, recorded_throughput_samples_per_s=recorded,
                measured_throughput_samples_per_s=None, ratio=None, memory_limit_bytes=options.memory_limit_bytes,
                message=f"the trial ended with {m.status}: {m.error.message if m.error else 'no reason given'}",
            )
        if statistics.median(r.throughput_samples_per_s or 0.0 for r in runs) >= floor:
            break  # within tolerance so far: no need to repeat; a regression is only declared after every repeat
    measured = statistics.median(m.throughput_samples_per_s or 0.0 for m in runs)
    ratio = measured / recorded
    if measured >= floor:
        status, message = "ok", (
            f"fits and runs at {measured:.1f} samples/s, {ratio:.0%} of the recorded {recorded:.1f}; it passes at "
            f"{floor:.1f} or more ({noise})"
        )
    else:
        status, message = "regressed", (
            f"{measured:.1f} samples/s (median of {len(runs)} runs) is {1 - ratio:.0%} below the recorded "
            f"{recorded:.1f}, under the {floor:.1f} a pass needs ({noise}); run autotune search to refresh the config"
        )
    return CheckResult(
        status=status, runs=tuple(runs), tolerance=tolerance, recorded_throughput_samples_per_s=recorded,
        measured_throughput_samples_per_s=measured, ratio=ratio, memory_limit_bytes=options.memory_limit_bytes,
        floor_samples_per_s=floor, message=message,
    )
