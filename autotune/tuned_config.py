"""The tuned config: what a search found, as a versioned YAML file that `check`, `export`, `report` and users read."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import os
import platform
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

import autotune
from autotune.candidate import Candidate, Measurement, WireDtype
from autotune.errors import ConfigError, InvalidCandidateError, UsageError
from autotune.schedules import Schedule, parse_schedule, validate_schedule
from autotune.units import format_bytes

SCHEMA_VERSION = 1
WIRE_DTYPES: tuple[WireDtype, ...] = ("float32", "bfloat16")
LayerRole = Literal["embedding", "block", "head", "other"]
LAYER_ROLES: tuple[LayerRole, ...] = ("embedding", "block", "head", "other")


@dataclass(frozen=True, kw_only=True)
class MeasuredResult:
    """What the real multi-process run of the chosen candidate measured."""

    step_time_ms: float
    """Median optimizer-step wall time (slowest rank)."""
    throughput_samples_per_s: float
    """global_batch_size / step time."""
    peak_memory_bytes: tuple[int, ...]
    """Peak memory per global rank."""


@dataclass(frozen=True, kw_only=True)
class PredictedResult:
    """What the simulator predicted for the chosen candidate, to compare with what was measured."""

    step_time_ms: float | None = None
    """Predicted step time; None when the candidate was not simulated."""
    peak_memory_bytes: tuple[int, ...] = ()
    """Predicted peak memory per pipeline rank; empty when not simulated."""


@dataclass(frozen=True, kw_only=True)
class SearchSummary:
    """Where the config came from: the Optuna study and how many trials it took."""

    study: str | None = None
    """Optuna study name; None when the config came from a single trial."""
    storage: str | None = None
    """Optuna storage URL (password masked); None for an in-memory study."""
    trials: int = 0
    """Trials run in the study."""
    feasible: int = 0
    """Trials that finished without OOM, timeout or error."""
    best_trial: int | None = None
    """Number of the trial this config was taken from."""


@dataclass(frozen=True, kw_only=True)
class Environment:
    """The software and device the measurement was taken on."""

    device: str
    """cpu, or the CUDA device name."""
    torch: str
    """torch version."""
    autotune: str
    """autotune version."""
    python: str
    """Python version."""

    @classmethod
    def current(cls, device: str) -> Environment:
        try:
            torch_version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_version = "unknown"
        return cls(device=device, torch=torch_version, autotune=autotune.__version__, python=platform.python_version())


@dataclass(frozen=True, kw_only=True)
class TunedConfig:
    """A tuned pipeline configuration, schema version 1. Fields are in the order of the YAML file."""

    version: int = SCHEMA_VERSION
    """Schema version; this autotune reads and writes 1."""
    model: str
    """The model file, as it was passed to `autotune search`."""
    model_sha256: str
    """Short content hash of the model file (autotune.model_file.fingerprint); `check` uses it to spot edits."""
    model_layers: int
    """Layers of the model's nn.Sequential; equals sum(layers_per_stage)."""
    gpus: int
    """Ranks in all: pipeline_degree x data_parallel_degree."""
    global_batch_size: int
    """B: samples per optimizer step over all replicas."""
    micro_batch_size: int
    """M: samples per micro-batch."""
    num_microbatches: int
    """Micro-batches each pipeline runs per step: B / (M x dp)."""
    pipeline_degree: int
    """pp: ranks in one pipeline."""
    data_parallel_degree: int
    """dp: replicas of the pipeline."""
    schedule: Schedule
    """Pipeline schedule, named as torch names it."""
    layers_per_stage: tuple[int, ...]
    """Layer count of each stage in model order; pp x stages-per-rank entries."""
    activation_checkpointing: bool
    """Each stage recomputes its forward in its backward instead of keeping activations."""
    layer_roles: tuple[LayerRole, ...] | None = None
    """What each layer is (embedding, transformer block, head, other), one per layer; None (key absent) when unknown.
    Exports use it to count transformer layers the way Megatron-LM and torchtitan do."""
    wire_dtype: WireDtype = "float32"
    """dtype of activations and gradients sent between stages."""
    memory_limit_bytes: int | None
    """Per-rank memory cap the search respected; None when there was none (CPU)."""
    measured: MeasuredResult
    """What the real run measured."""
    predicted: PredictedResult = PredictedResult()
    """What the simulator predicted."""
    search: SearchSummary = SearchSummary()
    """The study the config came from."""
    environment: Environment
    """Software and device of the measurement."""
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Top-level keys this version does not know, kept so that saving a newer file does not drop them."""

    def __post_init__(self) -> None:
        _check_values(self)

    @property
    def candidate(self) -> Candidate:
        """The configuration as a Candidate, to run with `trial` or rebuild with `runtime`."""
        return Candidate(
            schedule=self.schedule,
            pipeline_degree=self.pipeline_degree,
            global_batch_size=self.global_batch_size,
            n_microbatches=self.num_microbatches,
            layers_per_stage=self.layers_per_stage,
            data_parallel_degree=self.data_parallel_degree,
            activation_checkpointing=self.activation_checkpointing,
            wire_dtype=self.wire_dtype,
        )

    @classmethod
    def from_measurement(
        cls,
        measurement: Measurement,
        *,
        model: str | Path,
        memory_limit_bytes: int | None,
        model_sha256: str | None = None,
        model_layers: int | None = None,
        predicted: PredictedResult | None = None,
        search: SearchSummary | None = None,
        environment: Environment | None = None,
    ) -> TunedConfig:
        """The config of a successful trial. model_sha256 defaults to the model file's fingerprint, model_layers to
        sum(layers_per_stage), environment to this process's; a password in search.storage is masked."""
        if measurement.status != "ok" or measurement.step_time_ms is None:
            raise ConfigError(
                f"cannot write a tuned config from a trial that ended with status {measurement.status!r}; "
                f"take the config from a trial whose status is 'ok'"
            )
        c = measurement.candidate
        if model_sha256 is None:
            from autotune.model_file import fingerprint  # imports torch; only the writer of a config needs it

            try:
                model_sha256 = fingerprint(Path(model))
            except OSError as exc:
                raise ConfigError(f"{model}: cannot read the model file to fingerprint it ({exc.strerror})") from None
        throughput = measurement.throughput_samples_per_s
        if throughput is None:
            throughput = c.global_batch_size / (measurement.step_time_ms / 1000.0)
        search = search or SearchSummary()
        if search.storage is not None:
            search = dataclasses.replace(search, storage=mask_password(search.storage))
        return cls(
            model=str(model),
            model_sha256=model_sha256,
            model_layers=sum(c.layers_per_stage) if model_layers is None else model_layers,
            gpus=c.world_size,
            global_batch_size=c.global_batch_size,
            micro_batch_size=c.micro_batch_size,
            num_microbatches=c.n_microbatches,
            pipeline_degree=c.pipeline_degree,
            data_parallel_degree=c.data_parallel_degree,
            schedule=c.schedule,
            layers_per_stage=tuple(c.layers_per_stage),
            activation_checkpointing=c.activation_checkpointing,
            wire_dtype=c.wire_dtype,
            memory_limit_bytes=memory_limit_bytes,
            measured=MeasuredResult(
                step_time_ms=float(measurement.step_time_ms),
                throughput_samples_per_s=float(throughput),
                peak_memory_bytes=tuple(measurement.peak_memory_bytes),
            ),
            predicted=predicted or PredictedResult(),
            search=search,
            environment=environment or Environment.current(measurement.device),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data in schema order (the order of the fields), as written to YAML; unknown keys go last."""
        data = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"}
        if self.layer_roles is None:  # optional key: absent when unknown
            del data["layer_roles"]
        data.update((key, value) for key, value in self.extra.items() if key not in data)
        return data


def _plain(value: Any) -> Any:
    if isinstance(value, Schedule):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


# ---------------------------------------------------------------------------------------------- reading

_Kind = Literal["int", "int?", "number", "number?", "str", "str?", "bool", "ints", "strs?", "section"]
_KIND_NAMES = {
    "int": "an integer",
    "int?": "an integer or null",
    "number": "a number",
    "number?": "a number or null",
    "str": "a string",
    "str?": "a string or null",
    "bool": "true or false",
    "ints": "a list of integers",
    "strs?": "a list of strings or null",
    "section": "a mapping of keys",
}
_TOP: dict[str, _Kind] = {
    "version": "int",
    "model": "str",
    "model_sha256": "str",
    "model_layers": "int",
    "gpus": "int",
    "global_batch_size": "int",
    "micro_batch_size": "int",
    "num_microbatches": "int",
    "pipeline_degree": "int",
    "data_parallel_degree": "int",
    "schedule": "str",
    "layers_per_stage": "ints",
    "activation_checkpointing": "bool",
    "layer_roles": "strs?",
    "wire_dtype": "str",
    "memory_limit_bytes": "int?",
    "measured": "section",
    "predicted": "section",
    "search": "section",
    "environment": "section",
}
_SECTIONS: dict[str, dict[str, _Kind]] = {
    "measured": {"step_time_ms": "number", "throughput_samples_per_s": "number", "peak_memory_bytes": "ints"},
    "predicted": {"step_time_ms": "number?", "peak_memory_bytes": "ints"},
    "search": {"study": "str?", "storage": "str?", "trials": "int", "feasible": "int", "best_trial": "int?"},
    "environment": {"device": "str", "torch": "str", "autotune": "str", "python": "str"},
}
_DEFAULTS: dict[str, Any] = {"wire_dtype": "float32", "layer_roles": None}
"""Keys a config may leave out, with the value they mean."""


def load_config(path: str | Path) -> TunedConfig:
    """Read a tuned config; any problem is a ConfigError whose one line names the problem and the fix."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; pass the YAML file written by `autotune search --output`") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory; pass the YAML file written by `autotune search --output`") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{path}: cannot be read ({reason}); pass a readable tuned config") from None
    return parse_config(text, source=str(path))


def parse_config(text: str, *, source: str = "<config>") -> TunedConfig:
    """Parse the YAML text of a tuned config (see load_config)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(
            f"{source}: not valid YAML ({problem}{where}); fix the file or write it again with `autotune search`"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: holds {_describe(data)}, not a tuned config (a mapping of keys like version, model, "
            f"schedule); pass the YAML file written by `autotune search --output`"
        )
    return config_from_dict(data, source=source)


def config_from_dict(data: Mapping[str, Any], *, source: str = "<config>") -> TunedConfig:
    """Check plain data (from YAML or JSON) against schema version 1 and build the config."""
    version = data.get("version")
    if "version" in data and (version != SCHEMA_VERSION or isinstance(version, bool)):
        fix = (
            "upgrade autotune to read it"
            if isinstance(version, int) and version > SCHEMA_VERSION
            else ("write it again with `autotune search`")
        )
        raise ConfigError(
            f"{source}: schema version {version!r} is not supported (this autotune reads version {SCHEMA_VERSION}); "
            f"{fix}"
        )

    missing = [key for key in _TOP if key not in data and key not in _DEFAULTS]
    for section, keys in _SECTIONS.items():
        if isinstance(data.get(section), dict):
            missing += [f"{section}.{key}" for key in keys if key not in data[section]]
    if missing:
        raise ConfigError(
            f"{source}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)}; add "
            f"{'them' if len(missing) > 1 else 'it'} or write the config again with `autotune search`"
        )

    wrong = [_wrong_type(key, data.get(key, _DEFAULTS.get(key)), kind) for key, kind in _TOP.items()]
    for section, keys in _SECTIONS.items():
        if isinstance(data[section], dict):
            wrong += [_wrong_type(f"{section}.{key}", data[section][key], kind) for key, kind in keys.items()]
    problems = [problem for problem in wrong if problem]
    if problems:
        raise ConfigError(f"{source}: {'; '.join(problems)}; fix the value{'s' if len(problems) > 1 else ''}")

    try:
        schedule = parse_schedule(data["schedule"])
    except UsageError:
        names = ", ".join(s.value for s in Schedule)
        raise ConfigError(f"{source}: unknown schedule {data['schedule']!r}; set schedule to one of: {names}") from None
    wire_dtype = data.get("wire_dtype", _DEFAULTS["wire_dtype"])
    if wire_dtype not in WIRE_DTYPES:
        raise ConfigError(f"{source}: wire_dtype {wire_dtype!r} is not one of {', '.join(WIRE_DTYPES)}; fix it")

    roles = data.get("layer_roles")
    if roles is not None and not set(roles) <= set(LAYER_ROLES):
        unknown = sorted(set(roles) - set(LAYER_ROLES))
        raise ConfigError(
            f"{source}: layer_roles has {', '.join(map(repr, unknown))}; each entry must be one of "
            f"{', '.join(LAYER_ROLES)}"
        )
    measured, predicted, search, env = (data[s] for s in ("measured", "predicted", "search", "environment"))
    try:
        return TunedConfig(
            version=data["version"],
            model=data["model"],
            model_sha256=data["model_sha256"],
            model_layers=data["model_layers"],
            gpus=data["gpus"],
            global_batch_size=data["global_batch_size"],
            micro_batch_size=data["micro_batch_size"],
            num_microbatches=data["num_microbatches"],
            pipeline_degree=data["pipeline_degree"],
            data_parallel_degree=data["data_parallel_degree"],
            schedule=schedule,
            layers_per_stage=tuple(data["layers_per_stage"]),
            activation_checkpointing=data["activation_checkpointing"],
            layer_roles=None if roles is None else tuple(roles),
            wire_dtype=wire_dtype,
            memory_limit_bytes=data["memory_limit_bytes"],
            measured=MeasuredResult(
                step_time_ms=float(measured["step_time_ms"]),
                throughput_samples_per_s=float(measured["throughput_samples_per_s"]),
                peak_memory_bytes=tuple(measured["peak_memory_bytes"]),
            ),
            predicted=PredictedResult(
                step_time_ms=None if predicted["step_time_ms"] is None else float(predicted["step_time_ms"]),
                peak_memory_bytes=tuple(predicted["peak_memory_bytes"]),
            ),
            search=SearchSummary(**{key: search[key] for key in _SECTIONS["search"]}),
            environment=Environment(**{key: env[key] for key in _SECTIONS["environment"]}),
            extra={key: value for key, value in data.items() if key not in _TOP},
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _wrong_type(key: str, value: Any, kind: _Kind) -> str | None:
    if value is None and kind.endswith("?"):
        return None
    base = kind.rstrip("?")
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {
        "int": is_int,
        "number": is_int or isinstance(value, float),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "ints": isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
        "strs": isinstance(value, list) and all(isinstance(v, str) for v in value),
        "section": isinstance(value, dict),
    }[base]
    return None if ok else f"{key} must be {_KIND_NAMES[kind]}, not {_describe(value)}"


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'} ({_short(value)})"
    return f"{type(value).__name__} {_short(value)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_values(c: TunedConfig) -> None:
    """Values that each parse but do not fit together; messages name the numbers and the fix."""
    if c.version != SCHEMA_VERSION:
        raise ConfigError(f"schema version {c.version} is not supported; this autotune writes {SCHEMA_VERSION}")
    for name in (
        "model_layers",
        "gpus",
        "global_batch_size",
        "micro_batch_size",
        "num_microbatches",
        "pipeline_degree",
        "data_parallel_degree",
    ):
        if getattr(c, name) < 1:
            raise ConfigError(f"{name} is {getattr(c, name)}; it must be at least 1")
    if c.memory_limit_bytes is not None and c.memory_limit_bytes < 1:
        raise ConfigError(f"memory_limit_bytes is {c.memory_limit_bytes}; give a positive byte count or null")
    pp, dp, b = c.pipeline_degree, c.data_parallel_degree, c.global_batch_size
    m, mb = c.num_microbatches, c.micro_batch_size
    if m * mb * dp != b:
        raise ConfigError(
            f"num_microbatches {m} x micro_batch_size {mb} x data_parallel_degree {dp} = {m * mb * dp}, but "
            f"global_batch_size is {b}; make the product equal global_batch_size"
        )
    if pp * dp != c.gpus:
        raise ConfigError(
            f"pipeline_degree {pp} x data_parallel_degree {dp} = {pp * dp}, but gpus is {c.gpus}; "
            f"make gpus equal pipeline_degree x data_parallel_degree"
        )
    split = list(c.layers_per_stage)
    if not split or len(split) % pp:
        raise ConfigError(
            f"layers_per_stage {split} has {len(split)} entries, not a multiple of pipeline_degree {pp}; "
            f"give one entry per stage, pipeline_degree x stages-per-rank in all"
        )
    if any(n < 1 for n in split):
        raise ConfigError(f"layers_per_stage {split} has an empty stage; give every stage at least one layer")
    if sum(split) != c.model_layers:
        raise ConfigError(
            f"layers_per_stage {split} covers {sum(split)} layers but model_layers is {c.model_layers}; "
            f"make the entries add up to {c.model_layers}"
        )
    if c.layer_roles is not None and len(c.layer_roles) != c.model_layers:
        raise ConfigError(
            f"layer_roles has {len(c.layer_roles)} entries but model_layers is {c.model_layers}; give one role per "
            f"layer or leave layer_roles out"
        )
    try:
        validate_schedule(c.schedule, pipeline_degree=pp, n_microbatches=m, n_stages=len(split))
    except InvalidCandidateError as exc:
        raise ConfigError(str(exc)) from None


# ---------------------------------------------------------------------------------------------- writing

_INLINE_COMMENTS = {
    "num_microbatches": "B / (M x dp): micro-batches per pipeline per step",
    "layers_per_stage": "stages in model order",
}


def dump_config(config: TunedConfig, *, command: str | None = None, filename: str = "CONFIG") -> str:
    """The YAML text of a config: a header saying how it was produced, then the keys in schema order."""
    search, env = config.search, config.environment
    source = (
        f"the best of {search.trials} trials ({search.feasible} feasible) of study {search.study!r}"
        if search.study
        else "a single measured trial"
    )
    header = [
        f"# autotune tuned config, schema version {SCHEMA_VERSION}.",
        (
            f"# Written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} by autotune {env.autotune} "
            f"(torch {env.torch}, Python {env.python}) from {source},"
        ),
        (
            f"# measured in a real pipelined run on {config.gpus} rank(s) of {env.device}; `predicted` is the "
            "simulator's estimate."
        ),
    ]
    if command:
        header.append(f"# Command: {' '.join(command.splitlines())}")
    header += [
        f"# Check it still holds: autotune check {filename}",
        f"# Use it elsewhere:     autotune export {filename} --format torchtitan|deepspeed|megatron",
    ]
    body = yaml.dump(config.to_dict(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=10_000)
    comments = dict(_INLINE_COMMENTS)
    if config.memory_limit_bytes is not None:
        comments["memory_limit_bytes"] = format_bytes(config.memory_limit_bytes)
    lines = [_with_comment(line, comments) for line in body.splitlines()]
    return "\n".join(header + lines) + "\n"


def save_config(config: TunedConfig, path: str | Path, *, command: str | None = None) -> Path:
    """Write the config atomically: a reader sees the old file or the new one, never a torn one."""
    path = Path(path)
    try:
        atomic_write_text(path, dump_config(config, command=command, filename=str(path)))
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot be written ({exc.strerror or exc}); pass --output with a writable path"
        ) from None
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Temp file in the same directory, fsync, then os.replace over the target (atomic on POSIX and Windows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o644
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    with contextlib.suppress(OSError, AttributeError):  # make the rename itself durable where the OS allows
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def mask_password(url: str) -> str:
    """'postgresql://u:secret@host/db' -> 'postgresql://u:***@host/db': configs get committed, passwords must not."""
    parts = urllib.parse.urlsplit(url)
    if not parts.password:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class _Dumper(yaml.SafeDumper):
    """Block mappings, flow lists ([3, 2, 2, 3]), null written as null."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


def _represent_none(dumper: yaml.SafeDumper, _: None) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:null", "null")


_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(type(None), _represent_none)


def _with_comment(line: str, comments: Mapping[str, str]) -> str:
    key, sep, value = line.partition(":")
    if sep and value.strip() and key in comments:  # top-level scalar lines only: nested keys are indented
        return f"{line}  # {comments[key]}"
    return line
