"""The first run on a CUDA card: one-rank (pp = 1) trials of recipes and a GPU-sized GPT against the simulator, the
memory a rank holds outside torch's allocator, and the CUDA constants fitted from them.

    python bench/cuda_first_run.py --out DIR            # on a GPU machine (one GPU: pp = 1 trials only)
    python bench/cuda_first_run.py --device cpu --quick  # a dry run of the same code on the CPU stand-in

For each model and precision (fp32, bf16): profile on the device, then trials of GPipe over M micro-batches of one
global batch, with and without activation checkpointing (one rank: every action is compute, no link). Each row has
the measured step time and allocator peak, the simulator's prediction with the current CUDA constants, and the
prediction with no per-action overhead (what the fit of the per-action overhead starts from). Also: the device memory a
rank uses beyond the allocator's reserved peak (the CUDA context and NCCL: devices.CUDA_RESERVED_BYTES), the reserved
peak over the allocated one (fragmentation: devices.CUDA_FRAGMENTATION), and what profiling leaves in the tuner.

Writes DIR/cuda_first_run.json after every trial (a run cut short keeps what it measured) and DIR/cuda_first_run.md at
the end. A model or trial that fails is recorded with its error; the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402
import torch  # noqa: E402

from autotune.candidate import Candidate  # noqa: E402
from autotune.model_file import load_model_file  # noqa: E402
from autotune.profiling import profile_model  # noqa: E402
from autotune.schedules import Schedule  # noqa: E402
from autotune.simulate import LinkModel, simulate  # noqa: E402
from autotune.trial import TrialOptions, run_trial  # noqa: E402

MODELS = {  # model file, global batch size
    "mlp": (ROOT / "recipes" / "mlp.py", 256),
    "gpt": (ROOT / "recipes" / "gpt.py", 64),
    "hf_llama": (ROOT / "recipes" / "hf_llama.py", 64),
    "gpt_cuda": (ROOT / "bench" / "models" / "gpt_cuda.py", 32),
}

CONTEXT_PROBE = r"""
import json, torch, torch.distributed as dist
torch.cuda.set_device(0)
torch.empty(1, device="cuda")
free, total = torch.cuda.mem_get_info()
out = {"total": total, "context": total - free - torch.cuda.memory_reserved()}
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
t = torch.ones(1 << 20, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
out["context_and_nccl"] = total - free - torch.cuda.memory_reserved()
dist.destroy_process_group()
print(json.dumps(out))
"""


def device_memory_probe() -> dict:
    """A fresh process's device memory outside the allocator: the CUDA context alone, then with a one-rank NCCL
    communicator that has run an all-reduce."""
    done = subprocess.run([sys.executable, "-c", CONTEXT_PROBE], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def tuner_memory(device: str) -> dict:
    if device != "cuda":
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "device_used": total - free}


def run_model(name: str, path: Path, batch_size: int, *, precision: str, device: str, micro_batches: list[int],
              steps: int, save) -> dict:
    spec = load_model_file(path)
    entry: dict = {"model": name, "precision": precision, "batch_size": batch_size, "rows": []}
    before = tuner_memory(device)
    started = time.perf_counter()
    sizes = sorted({batch_size // m for m in micro_batches})
    profile = profile_model(spec, batch_size=batch_size, micro_batch_sizes=sizes, device=device, precision=precision)
    entry["profile_s"] = time.perf_counter() - started
    entry["tuner_memory_before_profile"], entry["tuner_memory_after_profile"] = before, tuner_memory(device)
    entry["parameter_bytes"] = sum(spec.parameter_bytes)
    entry["device_workspace_bytes"] = profile.device_workspace_bytes
    link = LinkModel.for_device(device)
    no_overhead = dataclasses.replace(link, per_action_overhead_ms=0.0)
    options = TrialOptions(steps=steps, warmup=2, device=device)
    for m in micro_batches:
        for ckpt in (False, True):
            candidate = Candidate(schedule=Schedule.GPIPE, pipeline_degree=1, global_batch_size=batch_size,
                                  n_microbatches=m, layers_per_stage=(spec.n_layers,), activation_checkpointing=ckpt,
                                  precision=precision)
            row: dict = {"candidate": candidate.key, "m": m, "ckpt": ckpt, "actions": 2 * m}
            try:
                est = simulate(profile, candidate, link=link, with_timeline=False)
                est0 = simulate(profile, candidate, link=no_overhead, with_timeline=False)
                row.update(predicted_ms=est.step_time_ms, predicted_ms_no_overhead=est0.step_time_ms,
                           predicted_optimizer_ms=est.optimizer_ms, predicted_peak=max(est.peak_memory_bytes))
                measured = run_trial(spec, candidate, options)
                row["status"] = measured.status
                if measured.status == "ok":
                    row.update(measured_ms=measured.step_time_ms, step_times_ms=list(measured.step_times_ms),
                               measured_peak=max(measured.peak_memory_bytes),
                               peak_reserved=max(measured.peak_reserved_bytes, default=0),
                               device_used=max(measured.device_used_bytes, default=0),
                               wall_s=measured.wall_time_s, phases_s=measured.phases_s)
                    row["time_error"] = (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
                    row["peak_error"] = (row["predicted_peak"] - row["measured_peak"]) / row["measured_peak"]
                else:
                    row["error"] = dataclasses.asdict(measured.error) if measured.error else None
            except Exception:  # noqa: BLE001 - a bench records what broke and goes on
                row["status"] = "exception"
                row["error"] = traceback.format_exc()[-3000:]
            entry["rows"].append(row)
            print(json.dumps({k: row.get(k) for k in ("candidate", "status", "measured_ms", "predicted_ms",
                                                      "measured_peak", "predicted_peak")}), flush=True)
            save()
    return entry


def fit(entries: list[dict]) -> dict:
    """Per-action overhead: the least-squares slope of (measured - predicted with no overhead) over the action count,
    with an intercept (a per-step cost outside the actions), over every ok row."""
    points = [(r["actions"], r["measured_ms"] - r["predicted_ms_no_overhead"]) for e in entries for r in e["rows"]
              if r.get("status") == "ok"]
    result: dict = {"points": len(points)}
    if len(points) >= 3:
        xs, ys = zip(*points)
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        result.update(per_action_overhead_ms=slope, per_step_intercept_ms=my - slope * mx)
    ok = [r for e in entries for r in e["rows"] if r.get("status") == "ok"]
    outside = [r["device_used"] - r["peak_reserved"] for r in ok if r.get("device_used")]
    frag = [r["peak_reserved"] / r["measured_peak"] - 1 for r in ok if r.get("peak_reserved") and r["measured_peak"]]
    if outside:
        result["outside_allocator_bytes"] = [min(outside), max(outside)]
    if frag:
        result["reserved_over_allocated"] = [min(frag), max(frag)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=300, help="start no model after this many seconds")
    parser.add_argument("--quick", action="store_true", help="mlp and gpt only, fp32, M = 1 and 2")
    args = parser.parse_args()
    if args.quick:
        args.models, args.micro_batches = ["mlp", "gpt"], [1, 2]
    args.out.mkdir(parents=True, exist_ok=True)
    data: dict = {"device": _results.device_line(args.device), "entries": []}

    def save() -> None:
        (args.out / "cuda_first_run.json").write_text(json.dumps(data, indent=1, default=str))

    if args.device == "cuda":
        data["device_memory_probe"] = device_memory_probe()
        data["link_defaults"] = dataclasses.asdict(LinkModel.for_device("cuda"))
        save()
    started = time.perf_counter()
    precisions = ["fp32"] if args.quick else ["fp32", "bf16"]
    for name in args.models:
        for precision in precisions:
            if time.perf_counter() - started > args.budget_s:
                data.setdefault("skipped", []).append(f"{name}/{precision}")
                continue
            path, batch_size = MODELS[name]
            try:
                data["entries"].append(run_model(name, path, batch_size, precision=precision, device=args.device,
                                                 micro_batches=args.micro_batches, steps=args.steps, save=save))
            except Exception:  # noqa: BLE001
                data["entries"].append({"model": name, "precision": precision, "error": traceback.format_exc()})
            save()
    data["fit"] = fit([e for e in data["entries"] if "rows" in e])
    save()
    rows = [[e["model"], e["precision"], r["candidate"], r.get("status"), r.get("measured_ms"), r.get("predicted_ms"),
             f"{r['time_error']:+.0%}" if "time_error" in r else "", r.get("measured_peak"), r.get("predicted_peak"),
             f"{r['peak_error']:+.1%}" if "peak_error" in r else "", r.get("peak_reserved"), r.get("device_used")]
            for e in data["entries"] if "rows" in e for r in e["rows"]]
    tables = {"pp = 1 trials against the simulator": _results.markdown_table(
        ["model", "precision", "candidate", "status", "measured ms", "predicted ms", "error", "allocated peak B",
         "predicted peak B", "peak error", "reserved peak B", "device used B"], rows),
        "fit": "```\n" + json.dumps(data["fit"], indent=1) + "\n```",
        "device memory outside the allocator (fresh process)": "```\n" + json.dumps(
            data.get("device_memory_probe"), indent=1) + "\n```"}
    _results.RESULTS = args.out
    _results.write("cuda_first_run", title="First CUDA run: pp = 1 trials against the simulator",
                   device=args.device, tables=tables, data=data)


if __name__ == "__main__":
    main()
