"""The one pipeline from a model file to a tuned config and its report: what `autotune search`, bench/ and scripts run.

    model file ──load, check──▶ ModelSpec ──profile──▶ Profile ──plan──▶ ranked candidates
        ──search (real trials, the leaders re-measured side by side)──▶ SearchResult
        ──keep the config already at `output` when the new best does not beat it, else write──▶ config
        ──▶ report

A TuneRequest goes in, a TuneOutcome comes out; a TuneReporter hears the progress (the CLI draws it on stderr).
Failures are AutotuneErrors: nothing fits (InfeasibleError), no trial ran, a bad model file; Ctrl-C before any
trial succeeded is re-raised as KeyboardInterrupt, after one it returns an outcome with result.interrupted set.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from autotune.candidate import DATA_PARALLEL_MODES, DataParallelMode, Measurement, Precision, WireDtype
from autotune.config_file import load_config, save_config
from autotune.costs import Profile
from autotune.errors import AutotuneError, ConfigError, UsageError
from autotune.files import ensure_writable
from autotune.model_file import ModelSpec
from autotune.profiling import ProgressFn
from autotune.records import SearchResult, explain_infeasible
from autotune.search import SearchReporter
from autotune.trial import TrialRunner
from autotune.tuned_config import Environment, PredictedResult, SearchSummary, TunedConfig, mask_password
from autotune.watchdog import MODEL_CHECK, time_limit

if TYPE_CHECKING:
    from autotune.simulate import LinkModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TuneRequest:
    """What to tune and how; the defaults are `autotune search`'s."""

    model: Path
    """The model file."""
    gpus: int
    """Ranks in all (pp x dp)."""
    batch_size: int
    """Global batch size B."""
    device: str = "auto"
    """auto (CUDA when present, else a LaunchError that says to pass cpu), cpu or cuda."""
    trials: int = 20
    """Real trial runs to spend, leader re-measurements included."""
    timeout_s: float | None = None
    """Stop launching trials after this long; None: no limit."""
    memory_limit_bytes: int | None = None
    """Per-rank memory cap; None: the device's memory less a headroom (devices.cuda_memory_budget_bytes; no cap on
    CPU)."""
    storage: str | None = None
    """Optuna storage URL; None: SQLite under .autotune/ named after the study."""
    study_name: str | None = None
    """None: <model>-<device>-g<gpus>-b<batch>."""
    resume: bool = False
    """Continue an existing study of that name."""
    seed: int = 0
    """Sampler seed."""
    steps: int = 5
    """Measured steps per trial."""
    warmup: int = 2
    """Unmeasured steps per trial."""
    trial_timeout_s: float | None = None
    """Seconds before one trial counts as hung; None: each trial's own bound from its predicted step time, at least
    300 s (trial.launch.trial_timeout_s)."""
    output: Path | None = Path("autotune.yaml")
    """Where the tuned config goes; None: write none (and keep none)."""
    min_improvement: float = 0.03
    """Keep a config already at `output` (same model, GPUs, batch) unless the new best beats it by more than this."""
    report_dir: Path | None = Path("autotune-report")
    """Where the report goes; None: write none."""
    command: str | None = None
    """The command line recorded in the config's header."""
    layouts: tuple[tuple[int, int], ...] | None = None
    """(pp, dp) layouts to search; None: every one the model and batch allow."""
    checkpointing: tuple[bool, ...] = (False, True)
    """Activation checkpointing choices to search."""
    wire_dtypes: tuple[WireDtype, ...] = ("float32", "bfloat16")
    """dtypes between stages to search."""
    split_at: tuple[str, ...] | None = None
    """Module names / globs to cut the model between (--split-at); None: the model file's SPLIT_AT /
    split_points(model), else autotune's own cut."""
    worker: str | None = None
    """This search's name among searches sharing the study (its budget counts its own launches); None: the host."""
    gpus_per_node: int | None = None
    """Ranks per node when the trials span nodes (autotune.cluster); None: one machine. The plan then knows which
    ranks share a node, and the config records nodes and gpus_per_node."""
    inter_node_link: tuple[float, float] | tuple[float, float, float | None, bool] | None = None
    """(latency s, bandwidth bytes/s[, all-reduce bandwidth bytes/s or None, whether the nodes are one machine])
    between nodes as the cluster's probe measured them; None: as inside a node."""
    intra_node_link: tuple[float, float] | None = None
    """(latency s, bandwidth bytes/s) between two GPUs of a node as probed before profiling (CUDA searches of 2+
    GPUs); None: the device's default link figures."""
    profile_every_block: bool = False
    """Profile every block, not one of each set of blocks that are the same."""
    precision: Precision | None = None
    """Compute precision of the profile and every trial; None: devices.default_precision (the model file's
    PRECISION, else bf16 on cuda, fp32 on cpu)."""
    data_parallel_modes: tuple[DataParallelMode, ...] = DATA_PARALLEL_MODES
    """How replicas may hold their stages, searched where dp > 1."""
    tensor_parallel_degrees: tuple[int, ...] | None = None
    """tp degrees to search; None: every one the model's tensor-parallel plan allows that divides the GPUs and fits a
    node (search_tp_degrees). A degree the model cannot take is refused (InvalidCandidateError)."""
    allow_async: bool = False
    """Plan and search the asynchronous schedules (2BW) too (--allow-async): they train with stale updates."""


@dataclass(frozen=True, kw_only=True)
class TuneOutcome:
    """What a tuning run found and wrote."""

    result: SearchResult
    """The search, every trial included; result.best is the chosen measurement."""
    spec: ModelSpec
    """The loaded model file."""
    profile: Profile
    """The profile the plan and the search were made from."""
    device: str
    """cpu or cuda, as resolved."""
    memory_limit_bytes: int | None
    """The per-rank cap the search respected."""
    config_path: Path | None
    """The tuned config (written now or kept); None when request.output was None."""
    config_written: bool
    """A new config was written."""
    kept_existing_config: bool
    """The config already at output still holds: the new best did not beat it by min_improvement."""
    report_dir: Path | None
    """Where report.md and report.html were written; None when request.report_dir was None."""
    worker: str = ""
    """This search's name among the searches of its study."""

    @property
    def launched_by_worker(self) -> int:
        """Real runs this search launched (result.launched counts every search's of the study)."""
        return sum(1 for r in self.result.records if r.launched and r.worker in (None, self.worker))

    @property
    def interrupted(self) -> bool:
        return self.result.interrupted


class TuneReporter(Protocol):
    """Progress of a tuning run. Each phase is a context manager around its work."""

    def profiling(self, description: str) -> AbstractContextManager[ProgressFn | None]: ...

    def planning(self, description: str) -> AbstractContextManager[Any]: ...

    def searching(self, budget: int) -> AbstractContextManager[SearchReporter | None]: ...

    def warning(self, text: str) -> None: ...


class SilentReporter:
    """No progress shown; warnings go to the log."""

    def profiling(self, description: str) -> AbstractContextManager[ProgressFn | None]:
        return contextlib.nullcontext()

    def planning(self, description: str) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def searching(self, budget: int) -> AbstractContextManager[SearchReporter | None]:
        return contextlib.nullcontext()

    def warning(self, text: str) -> None:
        log.warning(text)


def load_and_profile(
    model: Path,
    batch_size: int,
    device: str,
    *,
    micro_batch_sizes: list[int] | None = None,
    repeats: int = 5,
    reporter: TuneReporter | None = None,
    split_at: tuple[str, ...] | None = None,
    check_timeout_s: float | None = None,
    timeout_flag: str = "--timeout",
    gpus: int | None = None,
    every_block: bool = False,
    memory_limit_bytes: int | None = None,
    precision: Precision | None = None,
    state_shards: int = 1,
) -> tuple[ModelSpec, Profile]:
    """Load and check the model file, then profile it: (spec, profile). A BatchNorm in a block is told to the
    reporter (its statistics are per micro-batch under pipelining). check_timeout_s bounds the loading and the check
    forward (HangError naming timeout_flag when they do not return in time); None: unbounded. gpus: profile (by
    default) only micro-batch sizes up to the largest a candidate over that many ranks can use. every_block and
    memory_limit_bytes: see profile_model (the limit binds the profiler as it binds trials). precision: what to
    measure in; None: devices.default_precision (the model file's PRECISION, else bf16 on cuda, fp32 on cpu).
    state_shards: see profile_model (the GPUs, where shard layouts are searched or planned)."""
    from autotune.devices import default_precision
    from autotune.model_file import check_model, load_model_file
    from autotune.plan import largest_micro_batch
    from autotune.profiling import default_micro_batch_sizes, profile_model

    reporter = reporter or SilentReporter()
    with time_limit(check_timeout_s, path=model, what=MODEL_CHECK, flag=timeout_flag):
        spec = load_model_file(model, split_at=split_at)
        check_model(spec, batch_size)
    if spec.has_batchnorm:
        reporter.warning(batchnorm_warning(spec))
    if micro_batch_sizes is None and gpus is not None:
        micro_batch_sizes = default_micro_batch_sizes(largest_micro_batch(gpus, batch_size, spec.n_layers))
    with reporter.profiling(f"profiling {model.name} on {device}") as progress:
        profile = profile_model(
            spec,
            batch_size=batch_size,
            micro_batch_sizes=micro_batch_sizes,
            device=device,
            repeats=repeats,
            progress=progress,
            every_block=every_block,
            memory_limit_bytes=memory_limit_bytes,
            precision=cast(Precision, precision or default_precision(device, spec.precision)),
            state_shards=state_shards,
        )
    if profile.infeasible_micro_batch_sizes:
        reporter.warning(infeasible_sizes_warning(profile))
    if profile.too_small_micro_batch_sizes:
        reporter.warning(too_small_sizes_warning(profile))
    return spec, profile


def infeasible_sizes_warning(profile: Profile) -> str:
    """The terminal's line about micro-batch sizes that ran out of memory while profiling."""
    sizes = ", ".join(map(str, profile.infeasible_micro_batch_sizes))
    return (
        f"micro-batch size(s) {sizes} ran out of memory for a single block while profiling: candidates with "
        f"micro-batches that large are left out (largest that fits: {profile.micro_batch_sizes[-1]})"
    )


def too_small_sizes_warning(profile: Profile) -> str:
    """The terminal's line about micro-batch sizes the model failed to train while profiling."""
    sizes = ", ".join(map(str, profile.too_small_micro_batch_sizes))
    return (
        f"micro-batch size(s) {sizes} failed to train while larger ones ran (a BatchNorm over one value per "
        f"channel, say): candidates with micro-batches that small are left out (smallest that trains: "
        f"{profile.micro_batch_sizes[0]})"
    )


def batchnorm_warning(spec: ModelSpec) -> str:
    """The terminal's line about BatchNorm blocks (the report says more)."""
    layers = ", ".join(spec.describe_layer(i) for i in spec.batchnorm_layers[:4])
    more = f" and {len(spec.batchnorm_layers) - 4} more" if len(spec.batchnorm_layers) > 4 else ""
    return (
        f"layer(s) {layers}{more} use BatchNorm: under pipelining its statistics are taken per micro-batch, so "
        f"training differs from one big batch when there is more than one micro-batch (or use GroupNorm/LayerNorm)"
    )


def tune(
    request: TuneRequest, reporter: TuneReporter | None = None, *, runner: TrialRunner | None = None
) -> TuneOutcome:
    """Profile, plan, search, keep or replace the config at request.output, write the report (module docstring).
    runner: how a trial runs (default: real multi-process runs; tests pass a simulation)."""
    from autotune.devices import cpu_oversubscription, device_memory_bytes, resolve_device
    from autotune.graph_cache import planning
    from autotune.plan import ensure_feasible, plan
    from autotune.schedules import TIED_ASYNC, allowed_schedules
    from autotune.search import SearchOptions, default_storage, default_study_name, run_search
    from autotune.shared_study import check_study_name
    from autotune.simulate import LinkModel
    from autotune.study_storage import default_worker, open_storage
    from autotune.trial import TrialOptions, run_trial
    from autotune.trial.launch import TRIAL_TIMEOUT_FLOOR_S

    reporter = reporter or SilentReporter()
    device = resolve_device(request.device)
    limit = request.memory_limit_bytes if request.memory_limit_bytes is not None else device_memory_bytes(device)
    _check_outputs(request)
    oversubscribed = cpu_oversubscription(request.gpus, device)
    if oversubscribed:
        reporter.warning(oversubscribed)
    name = request.study_name or default_study_name(request.model, request.gpus, request.batch_size, device)
    # The storage first: a bad URL or a study name in use fails in a second, not after profiling.
    storage = open_storage(request.storage or default_storage(name), say=reporter.warning)
    check_study_name(storage, name, resume=request.resume)
    trial_bound = request.trial_timeout_s or TRIAL_TIMEOUT_FLOOR_S
    bound = min(trial_bound, request.timeout_s or trial_bound)
    spec, profile = load_and_profile(
        request.model, request.batch_size, device, reporter=reporter, check_timeout_s=bound,
        timeout_flag="--trial-timeout", gpus=request.gpus, split_at=request.split_at,
        every_block=request.profile_every_block, memory_limit_bytes=limit, precision=request.precision,
        state_shards=request.gpus if "shard" in request.data_parallel_modes else 1,
    )
    incumbent = _incumbent(request, spec, reporter)
    tp_degrees = search_tp_degrees(spec, request.gpus, request.gpus_per_node, request.tensor_parallel_degrees)
    tied = bool(profile.shared_parameters)
    if request.allow_async and tied:
        reporter.warning(f"--allow-async: {TIED_ASYNC}; searching the synchronous schedules only")
    precision = profile.precision  # request.precision, else devices.default_precision: what the profile measured
    link = probed_link(LinkModel.for_profile(profile), intra=request.intra_node_link,
                       inter=request.inter_node_link)
    with reporter.planning(f"planning {request.gpus} ranks..."), planning():
        planned = plan(profile, gpus=request.gpus, batch_size=request.batch_size, memory_limit_bytes=limit,
                       gpus_per_node=request.gpus_per_node, link=link, tensor_parallel_degrees=tp_degrees,
                       data_parallel_modes=request.data_parallel_modes,
                       schedules=allowed_schedules(request.allow_async, tied=tied))
    ensure_feasible(planned)
    options = SearchOptions(
        gpus=request.gpus,
        batch_size=request.batch_size,
        n_trials=request.trials,
        timeout_s=request.timeout_s,
        memory_limit_bytes=limit,
        resume=request.resume,
        seed=request.seed,
        layouts=request.layouts,
        checkpointing=request.checkpointing,
        wire_dtypes=request.wire_dtypes,
        precision=precision,
        data_parallel_modes=request.data_parallel_modes,
        tensor_parallel_degrees=tp_degrees,
        schedules=allowed_schedules(request.allow_async, tied=tied),
        incumbent=incumbent.candidate if incumbent else None,
        worker=request.worker or default_worker(),
        gpus_per_node=request.gpus_per_node,
        setup={"nodes": request.gpus // request.gpus_per_node, "gpus_per_node": request.gpus_per_node}
        if request.gpus_per_node else {},
        trial_timeout_s=request.trial_timeout_s,
        trial=TrialOptions(
            steps=request.steps,
            warmup=request.warmup,
            timeout_s=trial_bound,
            memory_limit_bytes=limit,
            device=device,
        ),
    )
    with reporter.searching(request.trials) as progress:
        result = run_search(
            spec,
            profile,
            planned,
            options,
            study_name=name,
            storage=storage,
            runner=runner or run_trial,
            reporter=progress,
            link=link,
        )
    if result.best is None:
        if result.interrupted:
            raise KeyboardInterrupt
        if any(r.outcome in ("oom", "pruned") for r in result.records) and limit is not None:
            raise explain_infeasible(result, limit)
        raise AutotuneError("no trial ran successfully; run `autotune report` on the study to see each reason")
    kept = written = False
    if request.output is not None:
        kept = _incumbent_holds(result, incumbent, request.min_improvement)
        if not kept:
            save_config(
                _config_of(result, result.best, request, spec, limit, device), request.output, command=request.command
            )
            written = True
    report_dir = None
    if request.report_dir is not None:
        from autotune.report import write_search_report

        report_dir = write_search_report(
            result,
            spec=spec,
            profile=profile,
            config_path=request.output,
            report_dir=request.report_dir,
            memory_limit_bytes=limit,
        )
    return TuneOutcome(
        result=result,
        spec=spec,
        profile=profile,
        device=device,
        memory_limit_bytes=limit,
        config_path=request.output,
        config_written=written,
        kept_existing_config=kept,
        report_dir=report_dir,
        worker=options.worker or "",
    )


def probed_link(
    base: LinkModel, *, intra: tuple[float, float] | None,
    inter: tuple[float, float] | tuple[float, float, float | None, bool] | None
) -> LinkModel | None:
    """The link model of a search from its probes, each (latency s, bandwidth bytes/s), over `base` (the profile's
    default, LinkModel.for_profile): inside a node, the probe's figures replace the device's defaults (on CUDA
    those are guesses: NVLink, PCIe and NVSwitch differ several times); between nodes, LinkModel.with_probe (with
    the inter-node probe's all-reduce bandwidth and whether the nodes are one machine, where it has them). None
    without probes: the planner's default for the profile."""
    from dataclasses import replace

    if intra is None and inter is None:
        return None
    link = base
    if intra is not None:
        link = replace(link, latency_s=intra[0], bandwidth_bytes_per_s=intra[1])
    if inter is not None:
        link = link.with_probe(inter_latency_s=inter[0], inter_bandwidth_bytes_per_s=inter[1],
                               inter_allreduce_bandwidth_bytes_per_s=inter[2] if len(inter) > 2 else None,
                               nodes_share_host=bool(inter[3]) if len(inter) > 3 else False,
                               intra_latency_s=intra[0] if intra else None,
                               intra_bandwidth_bytes_per_s=intra[1] if intra else None)
    return link


def search_tp_degrees(
    spec: ModelSpec, gpus: int, gpus_per_node: int | None, asked: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """The tp degrees a search of `gpus` ranks asks (layouts.tensor_parallel_degrees): those the model's plan allows
    (models.allowed_tp_degrees; a model without a plan: 1 only), or the `asked` ones, each checked against the plan
    (models.plan_for_degree: InvalidCandidateError naming what refuses it) and the ranks (UsageError)."""
    from autotune.layouts import tensor_parallel_degrees
    from autotune.models import allowed_tp_degrees, plan_for_degree

    node = gpus_per_node or gpus
    if asked is None:
        return tensor_parallel_degrees(gpus, allowed_tp_degrees(spec, node), gpus_per_node)
    for tp in asked:
        if tp > 1:
            plan_for_degree(spec, tp)
        if tp < 1 or gpus % tp or node % tp:
            raise UsageError(f"tensor-parallel degree {tp} does not divide the {node} GPUs of a node; use a divisor "
                             f"of {node}")
    return tuple(sorted(set(asked)))


def _check_outputs(request: TuneRequest) -> None:
    """The config and the report are written after the whole search: find an unwritable path before the first
    trial, not after the last."""
    for path, flag, folder in ((request.output, "--output", False), (request.report_dir, "--report-dir", True)):
        if path is None:
            continue
        try:
            ensure_writable(path, folder=folder)
        except OSError as exc:
            reason = exc.strerror or exc
            raise UsageError(f"{path}: cannot be written ({reason}); pass {flag} with a writable path") from None


def _incumbent(request: TuneRequest, spec: ModelSpec, reporter: TuneReporter) -> TunedConfig | None:
    """The config already at request.output, when it is for this model, GPU count and batch size."""
    output = request.output
    if output is None or not output.exists():
        return None
    try:
        config = load_config(output)
    except ConfigError as exc:
        reporter.warning(f"ignoring the existing {output}: {exc}")
        return None
    if (config.model_layers, config.gpus, config.global_batch_size) != (
        spec.n_layers,
        request.gpus,
        request.batch_size,
    ):
        reporter.warning(f"{output} is for another model, GPU count or batch size; it will be replaced")
        return None
    return config


def _incumbent_holds(result: SearchResult, incumbent: TunedConfig | None, min_improvement: float) -> bool:
    """The existing config was re-measured and the new best does not beat it by more than min_improvement."""
    best = result.best
    if incumbent is None or best is None:
        return False
    old = next((leader for leader in result.leaders if leader.candidate.key == incumbent.candidate.key), None)
    if old is None:
        return False
    return old.candidate.key == best.candidate.key or old.step_time_ms <= best.step_time_ms * (1 + min_improvement)  # type: ignore[operator]


def _config_of(
    result: SearchResult, best: Measurement, request: TuneRequest, spec: ModelSpec, limit: int | None, device: str
) -> TunedConfig:
    """The tuned config of the search's best measurement."""
    estimate = result.best_estimate
    runs = next((leader.step_times_ms for leader in result.leaders if leader.candidate == best.candidate), ())
    return TunedConfig.from_measurement(
        best,
        model=str(request.model),
        memory_limit_bytes=limit,
        model_layers=spec.n_layers,
        layer_roles=spec.layer_roles if spec.family != "sequential" else None,
        split_at=spec.split_at,
        layer_parameter_bytes=tuple(spec.parameter_bytes),
        runs_step_time_ms=tuple(runs),
        predicted=PredictedResult(
            step_time_ms=estimate.step_time_ms, peak_memory_bytes=tuple(estimate.peak_memory_bytes)
        )
        if estimate
        else None,
        search=SearchSummary(
            study=result.study_name,
            storage=mask_password(result.storage),
            trials=len(result.records),
            feasible=result.feasible,
            best_trial=result.best_trial,
        ),
        environment=Environment.current(device),
        nodes=request.gpus // request.gpus_per_node if request.gpus_per_node else None,
        gpus_per_node=request.gpus_per_node,
    )
