"""Sharded data parallel (FSDP2): the memory model's peak per rank against measured peaks on the CPU stand-in
(issue 23: within 10 % on at least three models).

For each model: profile it at the precision asked, then run each configuration as the trial worker runs it (gloo,
one thread per rank, runtime.build_pipeline over init_groups, 2 warm-up steps, then one tracked step) of sharded
layouts (pp 1 x dp 2, pp 2 x dp 2; keeping the stages gathered and resharding after forward; GPipe and 1F1B) and of
one replicate layout to compare, and set the simulator's peak per pipeline rank against the measured one.

Measured twice in the same step: by the trials' tracker (autotune.trial.memory.LiveTensorBytes: live tensor
storages as operators create them) and by the same tracker also following FSDP2's storage resizes. FSDP2 gathers a
unit's parameters into storages it keeps and resizes (_fsdp_param.alloc_storage / free_storage: resize_, which no
operator dispatch sees), so the trials' tracker misses the gathered working copy; a GPU allocator would not. The
comparison is against the resize-aware peak.

    python bench/memory_shard.py [--recipes mlp gpt cnn] [--precision fp32 bf16] [--batch-size 16]

Exits 1 when a sharded configuration's predicted peak is off by more than --tolerance (default 10 %).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from autotune.candidate import Candidate, uniform_split  # noqa: E402
from autotune.devices import keep_freed_cpu_memory  # noqa: E402
from autotune.model_file import check_model, load_model_file, make_batch  # noqa: E402
from autotune.process_groups import RankLayout, init_groups  # noqa: E402
from autotune.profiling import profile_model  # noqa: E402
from autotune.runtime import build_pipeline  # noqa: E402
from autotune.schedules import Schedule  # noqa: E402
from autotune.simulate import simulate  # noqa: E402
from autotune.trial.memory import LiveTensorBytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def layouts(n_layers: int, batch_size: int, precision: str) -> list[Candidate]:
    """Sharded layouts over 2 and 4 ranks, both reshard settings, GPipe and 1F1B, and a replicate one to compare."""
    out = []
    for pp, dp, schedule, m in ((1, 2, Schedule.ONE_F_ONE_B, 2), (1, 2, Schedule.ONE_F_ONE_B, 4),
                                (2, 2, Schedule.ONE_F_ONE_B, 4), (2, 2, Schedule.GPIPE, 4)):
        for mode, reshard in (("shard", False), ("shard", True), ("replicate", False)):
            if mode == "replicate" and (pp, m, schedule) != (2, 4, Schedule.ONE_F_ONE_B):
                continue
            out.append(Candidate(schedule=schedule, pipeline_degree=pp, data_parallel_degree=dp,
                                 global_batch_size=batch_size, n_microbatches=m,
                                 layers_per_stage=uniform_split(n_layers, pp), precision=precision,
                                 data_parallel_mode=mode, reshard_after_forward=reshard))
    return out


class ResizeAware(LiveTensorBytes):
    """LiveTensorBytes that also follows FSDP2's storage resizes (its gathered parameters)."""

    def resized(self, tensor: torch.Tensor, nbytes: int) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._live:
            self._live[key] = 0
            weakref.finalize(storage, self._free, key)
        self.live_bytes += nbytes - self._live[key]
        self._live[key] = nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes


def _follow_resizes(trackers: list[ResizeAware]) -> None:
    """Route FSDP2's alloc_storage / free_storage (module-level names in the modules that call them) through the
    trackers that are active."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    original_alloc, original_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor: torch.Tensor) -> None:
        original_alloc(tensor)
        for t in trackers:
            t.resized(tensor, tensor.untyped_storage().nbytes())

    def free_storage(tensor: torch.Tensor) -> None:
        original_free(tensor)
        for t in trackers:
            t.resized(tensor, 0)

    _fsdp_param.alloc_storage = alloc_storage
    _fsdp_param.free_storage = free_storage
    _fsdp_param_group.alloc_storage = alloc_storage


def _rank(rank: int, model: str, candidate: dict[str, Any], store: str, out: str) -> None:
    """One rank, as the trial worker runs it: setup, warm-up, one tracked step (both trackers at once)."""
    torch.set_num_threads(1)
    keep_freed_cpu_memory()
    c = Candidate.from_dict(candidate)
    dist.init_process_group("gloo", store=dist.FileStore(store, c.world_size), rank=rank, world_size=c.world_size)
    spec = load_model_file(Path(model))
    pp_group, dp_group = init_groups(RankLayout.of(c, rank))
    pipe = build_pipeline(spec, c, rank=rank, device=torch.device("cpu"), pp_group=pp_group, dp_group=dp_group)
    batch = pipe.prepare_batch(*make_batch(spec, c.replica_batch_size), replica_rows=True)
    trackers: list[ResizeAware] = []
    _follow_resizes(trackers)
    for _ in range(2):
        pipe.step(batch)
    plain, aware = LiveTensorBytes(), ResizeAware()
    with plain, aware:
        trackers.append(aware)
        pipe.step(batch)
        trackers.clear()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"plain": plain.peak_bytes, "aware": aware.peak_bytes}))
    dist.barrier()
    dist.destroy_process_group()


def measure(model: Path, c: Candidate) -> list[dict[str, int]]:
    """Per global rank: the trials' tracker's peak and the resize-aware one."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(str(model), c.to_dict(), os.path.join(tmp, "store"), tmp),
                           nprocs=c.world_size, start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(c.world_size)]


def compare(recipe: str, precision: str, batch_size: int) -> list[dict[str, Any]]:
    path = Path(recipe) if recipe.endswith(".py") else ROOT / "recipes" / f"{recipe}.py"
    spec = load_model_file(path)
    check_model(spec, batch_size)
    sizes = sorted({batch_size // (dp * m) for c in layouts(spec.n_layers, batch_size, precision)
                    for dp, m in [(c.data_parallel_degree, c.n_microbatches)]})
    profile = profile_model(spec, batch_size=batch_size, micro_batch_sizes=sizes, device="cpu", repeats=1,
                            precision=precision)
    rows = []
    for c in layouts(spec.n_layers, batch_size, precision):
        started = time.time()
        try:
            ranks = measure(path, c)
        except Exception as exc:  # noqa: BLE001 - a failed configuration is a row, the others still run
            rows.append({"model": recipe, "candidate": c.key, "status": "error",
                         "error": " ".join(str(exc).split())[:200], "wall_s": time.time() - started})
            print(f"{recipe} {c.key}: {exc}", file=sys.stderr)
            continue
        took = time.time() - started
        predicted = simulate(profile, c, with_timeline=False).peak_memory_bytes
        # per global rank; pipeline rank r's replicas (pp-inner: ranks r, r + pp, ...) hold the same
        measured = [max(x["aware"] for x in ranks[r::c.pipeline_degree]) for r in range(c.pipeline_degree)]
        trials = [max(x["plain"] for x in ranks[r::c.pipeline_degree]) for r in range(c.pipeline_degree)]
        errors = [(p - q) / q for p, q in zip(predicted, measured)]
        worst = max(range(len(errors)), key=lambda i: abs(errors[i]))
        rows.append({"model": recipe, "candidate": c.key, "status": "ok", "sharded": c.sharded,
                     "predicted": list(predicted), "measured": measured, "trial_tracker": trials, "errors": errors,
                     "worst_error": errors[worst], "wall_s": took})
        print(f"{recipe} {c.key}: predicted {list(predicted)} measured {measured} (trial tracker {trials}) "
              f"({errors[worst]:+.1%})", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["mlp", "gpt", "cnn"])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tolerance", type=float, default=0.10)
    args = parser.parse_args()
    torch.multiprocessing.set_sharing_strategy("file_system")
    if importlib.util.find_spec("autotune.sharding") is None:
        raise SystemExit("this checkout has no sharded runtime (autotune.sharding): trials of shard layouts would "
                         "not shard; run it on a branch with the FSDP2 runtime")
    rows = [r for recipe in args.recipes for precision in args.precision
            for r in compare(recipe, precision, args.batch_size)]
    ok = [r for r in rows if r["status"] == "ok"]
    table = _results.markdown_table(
        ["model", "candidate", "measured peak B per pipeline rank", "predicted", "error (worst rank)",
         "trials' tracker (misses FSDP2's resizes)"],
        [[r["model"], r["candidate"], r["measured"], r["predicted"], f"{r['worst_error']:+.1%}", r["trial_tracker"]]
         for r in ok]
        + [[r["model"], r["candidate"], r["status"], r["error"][:80], "-", "-"] for r in rows if r["status"] != "ok"])
    summary = []
    for model in args.recipes:
        for sharded in (True, False):
            errs = [abs(r["worst_error"]) for r in ok if r["model"] == model and r["sharded"] == sharded]
            if errs:
                summary.append([model, "shard" if sharded else "replicate", len(errs),
                                f"{statistics.fmean(errs):.1%}", f"{max(errs):.1%}",
                                sum(e > args.tolerance for e in errs)])
    tables = {
        "summary: |predicted - measured| / measured, worst pipeline rank": _results.markdown_table(
            ["model", "data parallel", "configs", "mean", "worst", f"over {args.tolerance:.0%}"], summary),
        "every configuration": table,
    }
    notes = ("Each configuration runs as `autotune trial --device cpu` runs it (the worker's steps, gloo, one thread "
             "per rank), 2 warm-up steps and 1 tracked; measured: live tensor bytes, FSDP2's storage resizes "
             "included (the last column: the trials' tracker, which misses them). Predicted: simulate() on a profile "
             "of the model at the configuration's precision and micro-batch size.")
    _results.write("memory_shard", title="Sharded data parallel: predicted vs measured peak memory", device="cpu",
                   tables=tables, data={"rows": rows}, notes=notes)
    bad = [r for r in ok if r["sharded"] and abs(r["worst_error"]) > args.tolerance]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
