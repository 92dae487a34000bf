"""Data-parallel gradient sync overlapped with the backward (DistributedDataParallel per stage) against one flat
all-reduce after the schedule: the measured step of pp 1 x dp 2 both ways, in the same two rank processes,
alternating, median of --steps each.

    python bench/dp_overlap.py --steps 20 --recipe mlp --batch-size 64 --microbatches 2

Not a test: on a shared or 2-core machine the two figures are noise. Run it on a quiet machine (or a GPU with
--device cuda) and read bench/results/dp_overlap.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def rank_main(rank: int, args: argparse.Namespace, run_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from autotune.candidate import Candidate
    from autotune.model_file import load_model_file, make_batch
    from autotune.runtime import RankLayout, build_pipeline, init_groups
    from autotune.schedules import Schedule

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=2,
                            store=dist.FileStore(str(Path(run_dir) / "store"), 2))
    spec = load_model_file(ROOT / args.model if args.model else ROOT / "recipes" / f"{args.recipe}.py")
    candidate = Candidate(schedule=Schedule.GPIPE, pipeline_degree=1, data_parallel_degree=2,
                          global_batch_size=args.batch_size, n_microbatches=args.microbatches,
                          layers_per_stage=(spec.n_layers,))
    pp_group, dp_group = init_groups(RankLayout.of(candidate, rank))
    pipes = {
        mode: build_pipeline(spec, candidate, rank=rank, device=device, pp_group=pp_group, dp_group=dp_group,
                             overlap_gradient_sync=mode == "overlapped")
        for mode in ("overlapped", "serialised")
    }
    assert pipes["overlapped"].replicated and not pipes["serialised"].replicated
    batch = {mode: pipe.prepare_batch(*make_batch(spec, candidate.replica_batch_size), replica_rows=True)
             for mode, pipe in pipes.items()}
    times: dict[str, list[float]] = {mode: [] for mode in pipes}
    for i in range(args.warmup + args.steps):
        for mode, pipe in pipes.items():
            dist.barrier()
            start = time.perf_counter()
            pipe.step(batch[mode])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= args.warmup:
                times[mode].append((time.perf_counter() - start) * 1000)
    (Path(run_dir) / f"times-{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="mlp")
    parser.add_argument("--model", default=None, help="a model file (relative to the repository), instead of --recipe")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--name", default="dp_overlap", help="results file name (bench/results/<name>.md)")
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="dp-overlap-")
    ctx = multiprocessing.get_context("forkserver")
    ranks = [ctx.Process(target=rank_main, args=(r, args, run_dir)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    if any(p.exitcode for p in ranks):
        sys.exit("a rank failed")
    per_rank = [json.loads((Path(run_dir) / f"times-{r}.json").read_text()) for r in range(2)]
    rows, data = [], {}
    for mode in ("overlapped", "serialised"):
        steps = [max(pair) for pair in zip(*(t[mode] for t in per_rank))]  # the slower rank's, step by step
        data[mode] = {"median_step_ms": statistics.median(steps), "steps_ms": steps}
        rows.append([mode, statistics.median(steps), min(steps), max(steps)])
    table = _results.markdown_table(["dp sync", "median step ms", "min", "max"], rows)
    print(table)
    _results.write(args.name, title="Data-parallel gradient sync: overlapped (DDP) vs one flat all-reduce",
                   device=args.device, tables={"steps": table}, data=data)


if __name__ == "__main__":
    main()
