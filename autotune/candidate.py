"""What one configuration is (Candidate) and what a real run of it measured (Measurement)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from autotune.errors import InvalidCandidateError, UsageError
from autotune.placement import RANK_ORDERS, RankOrder
from autotune.schedules import SCHEDULES, Schedule, parse_schedule, validate_schedule

TrialStatus = Literal["ok", "oom", "timeout", "error"]
ErrorKind = Literal["oom", "timeout", "error"]
WireDtype = Literal["float32", "bfloat16"]
Precision = Literal["fp32", "bf16"]
"""fp32: everything in float32. bf16: bfloat16 compute with float32 master weights, optimizer state and gradient
reduction (FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) when sharded, torch.autocast
otherwise), as torchtitan, Megatron (--bf16) and DeepSpeed (bf16.enabled) train."""
DataParallelMode = Literal["replicate", "shard"]
"""replicate: each replica holds its whole stages (DistributedDataParallel). shard: FSDP2 (fully_shard) over the
replicas: parameters, gradients and optimizer state split dp ways, gathered per stage for its compute."""
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")
PARALLELISMS = ("pipeline", "pipeline + FSDP", "tensor parallel", "FSDP", "data parallel", "one rank")
"""How a candidate spreads the model over the ranks, the question a user asks first (Candidate.parallelism): a
pipeline (pp > 1) with replicated or FSDP-sharded replicas, tensor parallelism (tp > 1, with or without a pipeline
and replicas), or no pipeline at all (pp = 1) with sharded (FSDP) or replicated (DDP) replicas."""
DATA_PARALLEL_MODES: tuple[DataParallelMode, ...] = ("replicate", "shard")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One point of the search space: everything a trial needs besides the model."""

    schedule: Schedule
    """Pipeline schedule."""
    pipeline_degree: int
    """Ranks in one pipeline (pp)."""
    global_batch_size: int
    """B: samples per optimizer step over all replicas."""
    n_microbatches: int
    """B/M per replica: micro-batches each pipeline runs per step."""
    layers_per_stage: tuple[int, ...]
    """Layer count of each stage in model order; pp x stages-per-rank entries."""
    data_parallel_degree: int = 1
    """Replicas of the pipeline (dp); gpus = pp x dp."""
    activation_checkpointing: bool = False
    """Recompute each stage's forward in its backward instead of keeping activations."""
    wire_dtype: WireDtype = "float32"
    """dtype of activations and gradients sent between stages."""
    precision: Precision = "fp32"
    """Compute precision (Precision): bf16 computes in bfloat16 over float32 master weights."""
    data_parallel_mode: DataParallelMode = "replicate"
    """How the dp replicas hold their stages (DataParallelMode): whole (replicate) or FSDP2-sharded (shard)."""
    reshard_after_forward: bool = False
    """shard only: FSDP2 frees the gathered parameters after each micro-batch's forward and gathers them again for
    its backward (less memory, an all-gather per micro-batch); False keeps each stage gathered for the whole step
    (torchtitan's default under a pipeline: one all-gather per stage and step)."""
    tensor_parallel_degree: int = 1
    """Ranks one stage's layers are split over with tensor parallelism (tp), consecutive ranks of one node; gpus =
    pp x dp x tp."""
    rank_order: RankOrder = "pp-inner"
    """How the pp x dp grid fills the global ranks (autotune.placement): pp-inner keeps each pipeline on consecutive
    ranks (inside a node), dp-inner each stage's replicas. Matters only across nodes."""

    @property
    def world_size(self) -> int:
        return self.pipeline_degree * self.data_parallel_degree * self.tensor_parallel_degree

    @property
    def n_stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def stages_per_rank(self) -> int:
        return self.n_stages // self.pipeline_degree

    @property
    def replica_batch_size(self) -> int:
        return self.global_batch_size // self.data_parallel_degree

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // (self.n_microbatches * self.data_parallel_degree)

    @property
    def key(self) -> str:
        """A short stable name, used to de-duplicate trials and label plots."""
        split = "-".join(map(str, self.layers_per_stage))
        extra = ("+ckpt" if self.activation_checkpointing else "") + ("+bf16" if self.wire_dtype == "bfloat16" else "")
        extra += "+dp-inner" if self.rank_order == "dp-inner" else ""
        extra += "+reshard" if self.reshard_after_forward else ""
        dp = ""
        if self.data_parallel_degree > 1:
            mode = "-shard" if self.data_parallel_mode == "shard" else ""
            dp = f"dp{self.data_parallel_degree}{mode}/"
        if self.tensor_parallel_degree > 1:
            dp += f"tp{self.tensor_parallel_degree}/"
        precision = "bf16:" if self.precision == "bf16" else ""
        return f"{precision}{dp}{self.schedule.value}/m{self.n_microbatches}/[{split}]{extra}"

    @property
    def parallelism(self) -> str:
        """Which of PARALLELISMS this candidate is: how it spreads the model over the ranks."""
        if self.tensor_parallel_degree > 1:
            return "tensor parallel"
        if self.pipeline_degree > 1:
            return "pipeline + FSDP" if self.sharded else "pipeline"
        if self.data_parallel_degree == 1:
            return "one rank"
        return "FSDP" if self.sharded else "data parallel"

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the stages over dp replicas (data_parallel_mode shard with dp > 1)."""
        return self.data_parallel_mode == "shard" and self.data_parallel_degree > 1

    @property
    def under_ddp(self) -> bool:
        """Whether the stages can run under DistributedDataParallel, their sync bucketed and overlapped with the last
        backward (runtime.overlaps_gradient_sync, which also keeps a rank whose stages share a parameter off it):
        replicas (dp > 1, not sharded), without tensor parallel (DDP over DTensor parameters is untested: the
        replicas average after the schedule), a schedule whose backwards are whole (torch's stage prepares DDP's
        reducer for a whole backward, not a split I / W) and whose steps are synchronous (2BW switches weight
        versions under the reducer). Otherwise the gradients are averaged after the schedule, in one flat
        all-reduce."""
        info = SCHEDULES[self.schedule]
        return (self.data_parallel_degree > 1 and not self.sharded and self.tensor_parallel_degree == 1
                and not info.splits_backward and not info.asynchronous)

    def validate(self, n_layers: int) -> None:
        """Refuse a candidate that cannot run, before any process starts; the message says how to fix it."""
        b, m, dp = self.global_batch_size, self.n_microbatches, self.data_parallel_degree
        if b < 1 or m < 1 or dp < 1 or self.pipeline_degree < 1:
            raise InvalidCandidateError("batch size, micro-batch count, pp and dp must all be at least 1")
        if self.rank_order not in RANK_ORDERS:
            raise InvalidCandidateError(f"rank order {self.rank_order!r} is not one of {', '.join(RANK_ORDERS)}")
        if self.tensor_parallel_degree < 1:
            raise InvalidCandidateError("tensor-parallel degree must be at least 1")
        if self.precision not in PRECISIONS:
            raise InvalidCandidateError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.data_parallel_mode not in DATA_PARALLEL_MODES:
            raise InvalidCandidateError(
                f"data-parallel mode {self.data_parallel_mode!r} is not one of {', '.join(DATA_PARALLEL_MODES)}"
            )
        if self.data_parallel_mode == "shard" and dp == 1:
            raise InvalidCandidateError("data-parallel mode shard needs dp > 1 (nothing to shard over); use replicate")
        if self.reshard_after_forward and self.data_parallel_mode != "shard":
            raise InvalidCandidateError("reshard_after_forward applies to sharded data parallelism only; leave it off")
        if b % (m * dp):
            raise InvalidCandidateError(
                f"global batch {b} cannot be cut into {dp} replica(s) x {m} equal micro-batches; "
                f"pass --microbatches with a divisor of {b // dp if b % dp == 0 else b}"
            )
        if self.n_stages > n_layers:
            raise InvalidCandidateError(
                f"{self.n_stages} stages need at least {self.n_stages} layers but the model has {n_layers}; "
                f"use fewer GPUs or a schedule with fewer stages per rank"
            )
        if sum(self.layers_per_stage) != n_layers:
            raise InvalidCandidateError(
                f"layers_per_stage {list(self.layers_per_stage)} covers {sum(self.layers_per_stage)} layers but the "
                f"model has {n_layers}; pass --layers-per-stage with {n_layers} in all"
            )
        if any(n < 1 for n in self.layers_per_stage):
            raise InvalidCandidateError(
                f"layers_per_stage {list(self.layers_per_stage)} has an empty stage; give every stage a layer"
            )
        validate_schedule(
            self.schedule, pipeline_degree=self.pipeline_degree, n_microbatches=m, n_stages=self.n_stages
        )
        if SCHEDULES[self.schedule].asynchronous and (self.sharded or self.tensor_parallel_degree > 1):
            what = "FSDP2-sharded replicas" if self.sharded else "tensor parallelism"
            raise InvalidCandidateError(
                f"{self.schedule.value} keeps two whole versions of each stage's weights and does not run with {what}; "
                f"use replicated data parallelism (--data-parallel replicate) without --tensor-parallel"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.value,
            "pipeline_degree": self.pipeline_degree,
            "data_parallel_degree": self.data_parallel_degree,
            "global_batch_size": self.global_batch_size,
            "num_microbatches": self.n_microbatches,
            "micro_batch_size": self.micro_batch_size,
            "layers_per_stage": list(self.layers_per_stage),
            "activation_checkpointing": self.activation_checkpointing,
            "wire_dtype": self.wire_dtype,
            **({"precision": self.precision} if self.precision != "fp32" else {}),
            **({"data_parallel_mode": self.data_parallel_mode} if self.data_parallel_mode != "replicate" else {}),
            **({"fsdp_reshard_after_forward": True} if self.reshard_after_forward else {}),
            **({"tensor_parallel_degree": self.tensor_parallel_degree} if self.tensor_parallel_degree != 1 else {}),
            **({"rank_order": self.rank_order} if self.rank_order != "pp-inner" else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        return cls(
            schedule=parse_schedule(data["schedule"]),
            pipeline_degree=int(data["pipeline_degree"]),
            data_parallel_degree=int(data.get("data_parallel_degree", 1)),
            global_batch_size=int(data["global_batch_size"]),
            n_microbatches=int(data["num_microbatches"]),
            layers_per_stage=tuple(int(n) for n in data["layers_per_stage"]),
            activation_checkpointing=bool(data.get("activation_checkpointing", False)),
            wire_dtype=data.get("wire_dtype", "float32"),
            precision=data.get("precision", "fp32"),
            data_parallel_mode=data.get("data_parallel_mode", "replicate"),
            reshard_after_forward=bool(data.get("fsdp_reshard_after_forward", False)),
            tensor_parallel_degree=int(data.get("tensor_parallel_degree", 1)),
            rank_order=data.get("rank_order", "pp-inner"),
        )


def stage_bounds(layers_per_stage: Sequence[int]) -> list[int]:
    """Index of each stage's first layer, and the layer count last: [3, 2, 2] -> [0, 3, 5, 7]."""
    return list(itertools.accumulate(layers_per_stage, initial=0))


def pipeline_layouts(gpus: int, batch_size: int, n_layers: int) -> list[tuple[int, int]]:
    """Every (pp, dp) with pp x dp = gpus, dp dividing the batch and a layer per pipeline rank, longest pipeline
    first; pp = 1 (plain data parallelism) included, so the planner says whether pipelining pays at all."""
    return [
        (gpus // dp, dp)
        for dp in range(1, gpus + 1)
        if gpus % dp == 0 and batch_size % dp == 0 and gpus // dp <= n_layers
    ]


def uniform_split(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Layers spread as evenly as possible; earlier stages take the remainder. A stage needs a layer."""
    if n_stages < 1:
        raise UsageError(f"cannot split into {n_stages} stages; ask for at least one")
    if n_stages > n_layers:
        raise InvalidCandidateError(
            f"{n_stages} stages need at least {n_stages} layers but the model has {n_layers}; "
            f"use fewer GPUs or a schedule with fewer stages per rank"
        )
    base, extra = divmod(n_layers, n_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(n_stages))


@dataclass(frozen=True, kw_only=True)
class TrialError:
    """Why a trial did not finish, and which rank caused it."""

    rank: int | None
    """Global rank that failed first of its own accord (None when no rank can be blamed)."""
    kind: ErrorKind
    """oom, timeout or error."""
    message: str
    """The failing rank's own message, one line."""
    bytes_requested: int | None = None
    """For oom: the allocation (or tracked peak) that did not fit."""
    node: int | None = None
    """The node of that rank in a multi-node trial (autotune.cluster); None on one machine."""


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What a real multi-process run of one candidate measured."""

    candidate: Candidate
    status: TrialStatus
    step_time_ms: float | None = None
    """Median of the measured steps' wall time (the slowest rank's, per step)."""
    step_times_ms: tuple[float, ...] = ()
    """Every measured step, in order."""
    throughput_samples_per_s: float | None = None
    peak_memory_bytes: tuple[int, ...] = ()
    """Per global rank: CUDA allocator peak, or live tensor bytes tracked on CPU (see trial.memory)."""
    peak_activation_bytes: tuple[int, ...] = ()
    """Per global rank: peak of the activations autograd saved for backward, part of peak_memory_bytes (see
    trial.memory.SavedActivationBytes); empty for measurements from before it was recorded."""
    peak_reserved_bytes: tuple[int, ...] = ()
    """Per global rank on CUDA: the caching allocator's reserved peak (torch.cuda.max_memory_reserved: the allocated
    peak plus fragmentation and cached blocks); () on CPU."""
    device_used_bytes: tuple[int, ...] = ()
    """Per global rank on CUDA: device memory in use after the measured steps (total - free: the reserved memory
    plus the CUDA context and NCCL's buffers, and other processes on a shared card); () on CPU."""
    loss: float | None = None
    """Mean loss of the last measured step."""
    losses: tuple[float, ...] = ()
    """Mean loss of every step the trial trained, warm-up steps first, in order (2BW's one step late: its steps
    train on weights one version old); () for measurements from before it was recorded."""
    error: TrialError | None = None
    wall_time_s: float = 0.0
    """The whole trial, launch to teardown, as the parent saw it."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Where the trial's time went (launch, setup, warmup, steps, teardown), slowest rank."""
    device: str = "cpu"
    wire_grad_rel_error: float | None = None
    """bf16 between stages: ||g_bf16 - g_fp32|| / ||g_fp32|| of the gradients of the first micro-batches (the fewest
    the schedule runs) against a float32 wire through the same stages, on a strided sample of each rank's gradient
    elements, the worst rank's; None when not measured (float32 wire, or TrialOptions.measure_wire_error off)."""
    rank_nodes: tuple[int, ...] = ()
    """Per global rank: the node it ran on (multi-node trials, autotune.cluster); () on one machine."""

    def to_dict(self) -> dict[str, Any]:
        data = {
            "status": self.status,
            "step_time_ms": self.step_time_ms,
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "peak_activation_bytes": list(self.peak_activation_bytes),
            "loss": self.loss,
            "losses": list(self.losses),
            "step_times_ms": list(self.step_times_ms),
            "wall_time_s": self.wall_time_s,
            "phases_s": dict(self.phases_s),
            "device": self.device,
            "wire_grad_rel_error": self.wire_grad_rel_error,
            "error": dataclasses.asdict(self.error) if self.error else None,
            **({"rank_nodes": list(self.rank_nodes)} if self.rank_nodes else {}),
            **({"peak_reserved_bytes": list(self.peak_reserved_bytes)} if self.peak_reserved_bytes else {}),
            **({"device_used_bytes": list(self.device_used_bytes)} if self.device_used_bytes else {}),
        }
        return {**self.candidate.to_dict(), **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        error = data.get("error")
        return cls(
            candidate=Candidate.from_dict(data),
            status=data["status"],
            step_time_ms=data.get("step_time_ms"),
            step_times_ms=tuple(data.get("step_times_ms", ())),
            throughput_samples_per_s=data.get("throughput_samples_per_s"),
            peak_memory_bytes=tuple(data.get("peak_memory_bytes", ())),
            peak_activation_bytes=tuple(data.get("peak_activation_bytes", ())),
            loss=data.get("loss"),
            losses=tuple(data.get("losses") or ()),
            error=TrialError(**error) if error else None,
            wall_time_s=float(data.get("wall_time_s", 0.0)),
            phases_s=dict(data.get("phases_s", {})),
            device=data.get("device", "cpu"),
            wire_grad_rel_error=data.get("wire_grad_rel_error"),
            rank_nodes=tuple(data.get("rank_nodes", ())),
            peak_reserved_bytes=tuple(data.get("peak_reserved_bytes", ())),
            device_used_bytes=tuple(data.get("device_used_bytes", ())),
        )
