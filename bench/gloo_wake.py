"""What a gloo collective costs a CPU rank beyond its wire time, once the rank has computed (autotune.simulate
COLLECTIVE_WAKE_CPU_MS): three measurements in two one-thread rank processes over gloo.

    python bench/gloo_wake.py --repeats 2

1. A 64 B all-reduce right after a barrier, after 8 ms asleep and after 8 ms of matrix products: gloo's threads
   sleep while the rank computes, and waking them is not free on every machine.
2. bench/models/mlp13.py (13 Linear blocks, 3.2 MB of gradients, micro-batch 128 per replica): forward + backward
   alone, under DistributedDataParallel (its 1 MiB first bucket and one more), and with ~0.25 MB buckets (13): what
   DDP's sync adds, and what each more bucket adds.
3. The same model under FSDP2 (fully_shard per block, no reshard after forward), 1 and 2 ranks: what each unit's
   all-gather (forward) and reduce-scatter (backward) adds beyond the half-batch compute.

Not a test: timings on a shared machine are noise; run it with nothing else busy and read bench/results/gloo_wake.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

MODEL = Path(__file__).resolve().parent / "models" / "mlp13.py"
BATCH = 256


def _model() -> Any:
    spec = importlib.util.spec_from_file_location("mlp13", MODEL)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def wake(rank: int, steps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    small, a = torch.zeros(16), torch.randn(256, 256)
    out = {}
    for mode in ("back to back", "after 8 ms asleep", "after 8 ms of compute"):
        times = []
        for _ in range(steps):
            dist.barrier()
            if mode == "after 8 ms asleep":
                time.sleep(0.008)
            elif mode == "after 8 ms of compute":
                end = time.perf_counter() + 0.008
                while time.perf_counter() < end:
                    a @ a
            t0 = time.perf_counter()
            dist.all_reduce(small)
            times.append(time.perf_counter() - t0)
        out[mode] = _median_ms(times[3:])
    return out


def ddp(rank: int, steps: int, variant: str) -> dict[str, float]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    module = _model()
    torch.manual_seed(0)
    model = module.build_model()
    x, y = module.make_batch(BATCH // 2)
    net = model
    if variant != "alone":
        cap = 25.0 if variant == "DDP" else 0.25
        net = DistributedDataParallel(model, broadcast_buffers=False, init_sync=False, gradient_as_bucket_view=True,
                                      bucket_cap_mb=cap)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        module.loss_fn(net(x), y).backward()
        times.append(time.perf_counter() - t0)
        for p in model.parameters():
            p.grad = None
    return {"forward + backward": _median_ms(times[3:])}


def fsdp(rank: int, world: int, steps: int) -> dict[str, float]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = _model()
    torch.manual_seed(0)
    model = module.build_model()
    mesh = init_device_mesh("cpu", (world,))
    units = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    x, y = module.make_batch(BATCH // world)
    forward, backward = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        module.loss_fn(out, y).backward()
        t2 = time.perf_counter()
        model.zero_grad()
        forward.append(t1 - t0)
        backward.append(t2 - t1)
    return {"units": len(units), "forward": _median_ms(forward[3:]), "backward": _median_ms(backward[3:])}


def rank_main(rank: int, world: int, port: int, what: str, steps: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if what == "wake":
            result = wake(rank, steps)
        elif what.startswith("fsdp"):
            result = fsdp(rank, world, steps)
        else:
            result = ddp(rank, steps, what)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def run(what: str, world: int, steps: int, port: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, what, steps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each measurement (one row each)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    port = 29600
    wake_rows, ddp_rows, fsdp_rows = [], [], []
    for repeat in range(args.repeats):
        port += 1
        w = run("wake", 2, args.steps, port)
        wake_rows.append([repeat + 1, *(f"{w[k]:.2f}" for k in w)])
        row = [repeat + 1]
        for variant, world in (("alone", 1), ("DDP", 2), ("DDP 0.25 MB buckets", 2)):
            port += 1
            row.append(f"{run(variant, world, args.steps, port)['forward + backward']:.2f}")
        ddp_rows.append(row)
        port += 1
        one = run("fsdp", 1, args.steps, port)
        port += 1
        two = run("fsdp", 2, args.steps, port)
        units = int(two["units"])
        fsdp_rows.append([repeat + 1, units, f"{one['forward']:.2f}", f"{two['forward']:.2f}",
                          f"{(two['forward'] - one['forward'] / 2) / units:.2f}", f"{one['backward']:.2f}",
                          f"{two['backward']:.2f}", f"{(two['backward'] - one['backward'] / 2) / units:.2f}"])
        print(wake_rows[-1], ddp_rows[-1], fsdp_rows[-1], flush=True)
    tables = {
        "a 64 B all-reduce, 2 ranks (median ms)": _results.markdown_table(
            ["run", "back to back", "after 8 ms asleep", "after 8 ms of compute"], wake_rows),
        "mlp13 forward + backward, micro-batch 128 per replica (median ms)": _results.markdown_table(
            ["run", "one rank alone", "DDP, 2 replicas (2 buckets)", "DDP, 0.25 MB buckets (13)"], ddp_rows),
        "mlp13 under FSDP2, batch 256 over the ranks (median ms)": _results.markdown_table(
            ["run", "units", "forward, 1 rank", "forward, 2 ranks", "per all-gather beyond half the compute",
             "backward, 1 rank", "backward, 2 ranks", "per reduce-scatter beyond half the compute"], fsdp_rows),
    }
    if args.no_write:
        _results.show(tables)
        return
    notes = ("DDP's sync costs the step what its column adds to 'one rank alone' (all of it: on the CPU stand-in "
             "the bucket all-reduces take the rank's own time). autotune.simulate.COLLECTIVE_WAKE_CPU_MS reads these "
             "figures.")
    _results.write("gloo_wake", title="What a gloo collective costs a CPU rank beyond its wire time",
                          device="cpu", tables=tables, data={"wake": wake_rows, "ddp": ddp_rows, "fsdp": fsdp_rows},
                          notes=notes)


if __name__ == "__main__":
    main()
