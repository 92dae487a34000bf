"""The tuned config: what a search found (schema version 1), the values that must fit together, and its plain-data
form. TunedConfig is the schema: its fields, in order, are the file's keys (autotune.config_file derives the key
checks from their types); the configuration proper is a Candidate, written flat as CANDIDATE_KEYS."""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import platform
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import autotune
from autotune.candidate import (
    DATA_PARALLEL_MODES,
    PRECISIONS,
    Candidate,
    DataParallelMode,
    Measurement,
    Precision,
    WireDtype,
)
from autotune.errors import ConfigError, InvalidCandidateError
from autotune.masking import mask_url as mask_password
from autotune.placement import RANK_ORDERS, RankOrder
from autotune.schedules import SCHEDULES, Schedule, parse_schedule, validate_schedule

SCHEMA_VERSION = 1
WIRE_DTYPES: tuple[WireDtype, ...] = typing.get_args(WireDtype)
LayerRole = Literal["embedding", "block", "head", "other"]
"""What a layer is in the model: the token/patch embedding, a repeated block, the head (norm + output), other."""
LAYER_ROLES: tuple[LayerRole, ...] = typing.get_args(LayerRole)


@dataclass(frozen=True, kw_only=True)
class MeasuredResult:
    """What the real multi-process run of the chosen candidate measured."""

    step_time_ms: float
    """Median optimizer-step wall time (slowest rank)."""
    throughput_samples_per_s: float
    """global_batch_size / step time."""
    peak_memory_bytes: tuple[int, ...]
    """Peak memory per global rank."""
    runs_throughput_samples_per_s: tuple[float, ...] = ()
    """Throughput of each run of this candidate the search took (its leaders are re-run side by side), in run order:
    their spread is the run-to-run noise `autotune check` judges a slowdown against. Empty: not recorded."""


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
    """Number of a trial of the chosen candidate (its first successful run)."""


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


CANDIDATE_KEYS: dict[str, str] = {
    "gpus": "world_size",
    "global_batch_size": "global_batch_size",
    "micro_batch_size": "micro_batch_size",
    "num_microbatches": "n_microbatches",
    "pipeline_degree": "pipeline_degree",
    "data_parallel_degree": "data_parallel_degree",
    "schedule": "schedule",
    "layers_per_stage": "layers_per_stage",
    "activation_checkpointing": "activation_checkpointing",
    "wire_dtype": "wire_dtype",
    "precision": "precision",
    "data_parallel_mode": "data_parallel_mode",
    "fsdp_reshard_after_forward": "reshard_after_forward",
    "tensor_parallel_degree": "tensor_parallel_degree",
    "rank_order": "rank_order",
}
"""The Candidate as the file writes it, in file order: key -> Candidate attribute (gpus and micro_batch_size are
derived from the others and checked against them on reading)."""

OPTIONAL_KEYS = frozenset(
    {"wire_dtype", "layer_roles", "split_at", "layer_parameter_bytes", "rank_order", "nodes", "gpus_per_node",
     "precision", "data_parallel_mode", "fsdp_reshard_after_forward", "tensor_parallel_degree"}
)
"""Keys added after schema version 1 first shipped: a file without them still loads (with the field's default)."""
ASYNCHRONOUS_KEY = "asynchronous"
"""Written (true) beside an asynchronous schedule (2BW), whose updates use a gradient one step stale; derived from
the schedule on reading (kept among the extra keys, checked against it)."""
OPTIONAL_SECTION_KEYS = frozenset({"measured.runs_throughput_samples_per_s"})
"""Keys of sections added after schema version 1 first shipped (section.key): a file without them still loads."""
_WRITTEN_IF_NOT_DEFAULT = {"rank_order": "pp-inner", "data_parallel_mode": "replicate",
                           "fsdp_reshard_after_forward": False, "tensor_parallel_degree": 1}
"""Candidate keys left out of the file at their default (a config from one node reads as before)."""


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
    """Layers of the model as autotune cuts it; equals sum(layers_per_stage)."""
    layer_roles: tuple[LayerRole, ...] | None = None
    """Optional, one per layer: embedding | block | head | other, for exporters that name layers by role (torchtitan
    counts the embedding and the head as layers of their own). Written only when known; None: unknown."""
    split_at: tuple[str, ...] | None = None
    """Optional: the module names / globs the model was cut at (--split-at, SPLIT_AT or split_points(model) in the
    model file); written only when given, so the config is rebuilt with the same layers. None: autotune's own cut."""
    layer_parameter_bytes: tuple[int, ...] | None = None
    """Optional, one per layer: its parameter bytes when tuned. `check` compares them with the model file's when its
    model_sha256 changed: a layer that grew or shrank means the config no longer applies. None: not recorded."""
    candidate: Candidate
    """The configuration itself; written flat as CANDIDATE_KEYS (gpus, global_batch_size, micro_batch_size,
    num_microbatches, pipeline_degree, data_parallel_degree, schedule, layers_per_stage, activation_checkpointing,
    wire_dtype, precision; data_parallel_mode and fsdp_reshard_after_forward when not replicate / false; rank_order
    when it is dp-inner)."""
    memory_limit_bytes: int | None
    """Per-rank memory cap the search respected; None when there was none (CPU)."""
    nodes: int | None = None
    """Nodes the ranks spanned when it was measured (multi-node searches); None: one machine."""
    gpus_per_node: int | None = None
    """Ranks per node when it was measured (multi-node searches); None: one machine."""
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
        check_values(self.to_dict())

    # The candidate's values under the names the file gives them (exporters and users read these).
    @property
    def gpus(self) -> int:
        """Ranks in all: pipeline_degree x data_parallel_degree."""
        return self.candidate.world_size

    @property
    def global_batch_size(self) -> int:
        """B: samples per optimizer step over all replicas."""
        return self.candidate.global_batch_size

    @property
    def micro_batch_size(self) -> int:
        """M: samples per micro-batch."""
        return self.candidate.micro_batch_size

    @property
    def num_microbatches(self) -> int:
        """Micro-batches each pipeline runs per step: B / (M x dp)."""
        return self.candidate.n_microbatches

    @property
    def pipeline_degree(self) -> int:
        """pp: ranks in one pipeline."""
        return self.candidate.pipeline_degree

    @property
    def data_parallel_degree(self) -> int:
        """dp: replicas of the pipeline."""
        return self.candidate.data_parallel_degree

    @property
    def schedule(self) -> Schedule:
        """Pipeline schedule, named as torch names it."""
        return self.candidate.schedule

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        """Layer count of each stage in model order; pp x stages-per-rank entries."""
        return self.candidate.layers_per_stage

    @property
    def activation_checkpointing(self) -> bool:
        """Each stage recomputes its forward in its backward instead of keeping activations."""
        return self.candidate.activation_checkpointing

    @property
    def wire_dtype(self) -> WireDtype:
        """dtype of activations and gradients sent between stages."""
        return self.candidate.wire_dtype

    @property
    def precision(self) -> Precision:
        """Compute precision: fp32, or bf16 over float32 master weights."""
        return self.candidate.precision

    @property
    def data_parallel_mode(self) -> DataParallelMode:
        """How the replicas hold their stages: replicate (whole) or shard (FSDP2)."""
        return self.candidate.data_parallel_mode

    @property
    def fsdp_reshard_after_forward(self) -> bool:
        """shard: gathered parameters are freed after each micro-batch's forward (True) or kept for the step."""
        return self.candidate.reshard_after_forward

    @property
    def tensor_parallel_degree(self) -> int:
        """tp: ranks each stage's layers are split over (consecutive ranks of one node)."""
        return self.candidate.tensor_parallel_degree

    @property
    def rank_order(self) -> RankOrder:
        """How the pp x dp grid fills the global ranks: pp-inner (a pipeline per node) or dp-inner."""
        return self.candidate.rank_order

    @classmethod
    def from_measurement(
        cls,
        measurement: Measurement,
        *,
        model: str | Path,
        memory_limit_bytes: int | None,
        model_sha256: str | None = None,
        model_layers: int | None = None,
        layer_roles: tuple[LayerRole, ...] | None = None,
        split_at: tuple[str, ...] | None = None,
        layer_parameter_bytes: tuple[int, ...] | None = None,
        runs_step_time_ms: tuple[float, ...] = (),
        predicted: PredictedResult | None = None,
        search: SearchSummary | None = None,
        environment: Environment | None = None,
        nodes: int | None = None,
        gpus_per_node: int | None = None,
    ) -> TunedConfig:
        """The config of a successful trial. model_sha256 defaults to the model file's fingerprint, model_layers to
        sum(layers_per_stage), environment to this process's; a password in search.storage is masked.
        runs_step_time_ms: the median step time of each run of this candidate (recorded as their throughputs)."""
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
            layer_roles=layer_roles,
            split_at=split_at,
            layer_parameter_bytes=layer_parameter_bytes,
            candidate=c,
            memory_limit_bytes=memory_limit_bytes,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            measured=MeasuredResult(
                step_time_ms=float(measurement.step_time_ms),
                throughput_samples_per_s=float(throughput),
                peak_memory_bytes=tuple(measurement.peak_memory_bytes),
                runs_throughput_samples_per_s=tuple(c.global_batch_size / (t / 1000.0) for t in runs_step_time_ms),
            ),
            predicted=predicted or PredictedResult(),
            search=search,
            environment=environment or Environment.current(measurement.device),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data in file order (the order of the fields, the candidate flat); unknown keys go last."""
        data: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "candidate":
                data.update(
                    (key, plain(getattr(value, attribute)))
                    for key, attribute in CANDIDATE_KEYS.items()
                    if _WRITTEN_IF_NOT_DEFAULT.get(key, object()) != getattr(value, attribute)
                )
                if SCHEDULES[value.schedule].asynchronous:  # said outright: the updates are one step stale
                    data[ASYNCHRONOUS_KEY] = True
            elif f.name != "extra" and not (f.name in OPTIONAL_KEYS and value is None):
                data[f.name] = plain(value)
        for dotted in OPTIONAL_SECTION_KEYS:  # written only when recorded, as the optional top-level keys
            section, key = dotted.split(".")
            if data[section].get(key) in ((), [], None):
                del data[section][key]
        data.update((key, value) for key, value in self.extra.items() if key not in data and key != ASYNCHRONOUS_KEY)
        return data


def plain(value: Any) -> Any:
    """A field value as YAML and JSON hold it: enums by value, tuples as lists, dataclasses as mappings."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def check_values(c: Mapping[str, Any]) -> None:
    """Values that each parse but do not fit together (c holds the file's keys); messages name the numbers and
    the fix."""
    if c["version"] != SCHEMA_VERSION:
        raise ConfigError(f"schema version {c['version']} is not supported; this autotune writes {SCHEMA_VERSION}")
    for name in (
        "model_layers",
        "gpus",
        "global_batch_size",
        "micro_batch_size",
        "num_microbatches",
        "pipeline_degree",
        "data_parallel_degree",
    ):
        if c[name] < 1:
            raise ConfigError(f"{name} is {c[name]}; it must be at least 1")
    if c["memory_limit_bytes"] is not None and c["memory_limit_bytes"] < 1:
        raise ConfigError(f"memory_limit_bytes is {c['memory_limit_bytes']}; give a positive byte count or null")
    pp, dp, b = c["pipeline_degree"], c["data_parallel_degree"], c["global_batch_size"]
    m, mb = c["num_microbatches"], c["micro_batch_size"]
    if m * mb * dp != b:
        raise ConfigError(
            f"num_microbatches {m} x micro_batch_size {mb} x data_parallel_degree {dp} = {m * mb * dp}, but "
            f"global_batch_size is {b}; make the product equal global_batch_size"
        )
    if c.get("rank_order", "pp-inner") not in RANK_ORDERS:
        raise ConfigError(f"rank_order {c['rank_order']!r} is not one of {', '.join(RANK_ORDERS)}; fix it")
    if c.get("precision", "fp32") not in PRECISIONS:
        raise ConfigError(f"precision {c['precision']!r} is not one of {', '.join(PRECISIONS)}; fix it")
    mode = c.get("data_parallel_mode", "replicate")
    if mode not in DATA_PARALLEL_MODES:
        raise ConfigError(f"data_parallel_mode {mode!r} is not one of {', '.join(DATA_PARALLEL_MODES)}; fix it")
    if mode == "shard" and c["data_parallel_degree"] == 1:
        raise ConfigError("data_parallel_mode shard needs data_parallel_degree > 1; set it to replicate")
    if c.get("fsdp_reshard_after_forward") and mode != "shard":
        raise ConfigError("fsdp_reshard_after_forward applies to data_parallel_mode shard only; remove it")
    for name in ("nodes", "gpus_per_node"):
        if c.get(name) is not None and c[name] < 1:
            raise ConfigError(f"{name} is {c[name]}; it must be at least 1, or left out")
    tp = c.get("tensor_parallel_degree", 1)
    if tp < 1:
        raise ConfigError(f"tensor_parallel_degree is {tp}; it must be at least 1, or left out")
    if pp * dp * tp != c["gpus"]:
        raise ConfigError(
            f"pipeline_degree {pp} x data_parallel_degree {dp}"
            f"{f' x tensor_parallel_degree {tp}' if tp != 1 else ''} = {pp * dp * tp}, but gpus is {c['gpus']}; "
            f"make gpus equal pipeline_degree x data_parallel_degree"
        )
    split, layers = list(c["layers_per_stage"]), c["model_layers"]
    if not split or len(split) % pp:
        raise ConfigError(
            f"layers_per_stage {split} has {len(split)} entries, not a multiple of pipeline_degree {pp}; "
            f"give one entry per stage, pipeline_degree x stages-per-rank in all"
        )
    if any(n < 1 for n in split):
        raise ConfigError(f"layers_per_stage {split} has an empty stage; give every stage at least one layer")
    if sum(split) != layers:
        raise ConfigError(
            f"layers_per_stage {split} covers {sum(split)} layers but model_layers is {layers}; "
            f"make the entries add up to {layers}"
        )
    layer_bytes = c.get("layer_parameter_bytes")
    if layer_bytes is not None and len(layer_bytes) != layers:
        raise ConfigError(
            f"layer_parameter_bytes has {len(layer_bytes)} entries but model_layers is {layers}; give one per layer "
            f"or drop layer_parameter_bytes"
        )
    roles = c.get("layer_roles")
    if roles is not None and len(roles) != layers:
        raise ConfigError(
            f"layer_roles has {len(roles)} entries but model_layers is {layers}; give one role per layer or drop "
            f"layer_roles"
        )
    try:
        validate_schedule(parse_schedule(c["schedule"]), pipeline_degree=pp, n_microbatches=m, n_stages=len(split))
    except InvalidCandidateError as exc:
        raise ConfigError(str(exc)) from None
