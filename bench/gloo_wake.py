"""What a gloo collective costs a CPU rank beyond its wire time, once the rank has computed (autotune.simulate
COLLECTIVE_WAKE_CPU_MS), what it costs per byte, and what FSDP2 costs around it: five measurements in two one-thread
rank processes over gloo.

    python bench/gloo_wake.py --repeats 2

1. A 64 B all-reduce right after a barrier, after 8 ms asleep and after 8 ms of matrix products: gloo's threads
   sleep while the rank computes, and waking them is not free on every machine.
2. bench/models/mlp13.py (13 Linear blocks, 3.2 MB of gradients, micro-batch 128 per replica): forward + backward
   alone, under DistributedDataParallel (its 1 MiB first bucket and one more), and with ~0.25 MB buckets (13): what
   DDP's sync adds, and what each more bucket adds.
3. The same model under FSDP2 (fully_shard per block, no reshard after forward), 1 and 2 ranks: what each unit's
   all-gather (forward) and reduce-scatter (backward) adds beyond the half-batch compute.
4. By unit size (--widths): 8 Linear(W, W) blocks, batch 32 over the ranks, alone, under DDP and under FSDP2 as in 2
   and 3, so that what a collective costs splits into a fixed part (the wake) and a part per byte (gloo's rate,
   which is not the point-to-point one: autotune.simulate.COLLECTIVE_CPU_BANDWIDTH_BYTES_PER_S and
   LinkModel.all_gather_passes and reduce_scatter_passes read the fit).
5. FSDP2's hooks (--widths): the same 8 units, 2 ranks, 4 micro-batches of 8 a step as torch's pipeline stage runs
   them (gradient sync, resharding after backward and the last backward's flag on the last only): micro-batches
   2-4, whose units are gathered already, against the same module unsharded: what each unit costs a forward and a
   backward (autotune.simulate.SHARD_UNIT_OVERHEAD_CPU_MS); and each one's AdamW step (torch's default on CPU: a
   tensor at a time), FSDP2's over its DTensor shards beyond half the unsharded one's, per unit (one
   parameter-holding module each: autotune.simulate.SHARDED_OPTIMIZER_GROUP_CPU_MS).

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


def _model(width: int = 0) -> Any:
    if width:
        return _Uniform(width)
    spec = importlib.util.spec_from_file_location("mlp13", MODEL)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _batch(width: int) -> int:
    """The global batch of part 4's units (width > 0), or of mlp13's parts 2 and 3."""
    return _Uniform.BATCH if width else BATCH


class _Uniform:
    """8 Linear(width, width) + ReLU blocks, batch 32: the same FSDP2 units at one size."""

    BLOCKS, BATCH = 8, 32

    def __init__(self, width: int) -> None:
        self.width = width

    def build_model(self) -> Any:
        import torch

        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(self.width, self.width), torch.nn.ReLU())
                                     for _ in range(self.BLOCKS)])

    def make_batch(self, batch: int) -> Any:
        import torch

        return torch.randn(batch, self.width), torch.randn(batch, self.width)

    def loss_fn(self, out: Any, y: Any) -> Any:
        return ((out - y) ** 2).mean()


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


def ddp(rank: int, steps: int, variant: str, width: int = 0) -> dict[str, float]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    module = _model(width)
    torch.manual_seed(0)
    model = module.build_model()
    x, y = module.make_batch(_batch(width) // 2)
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


def fsdp(rank: int, world: int, steps: int, width: int = 0) -> dict[str, float]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = _model(width)
    torch.manual_seed(0)
    model = module.build_model()
    mesh = init_device_mesh("cpu", (world,))
    units = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    x, y = module.make_batch(_batch(width) // world)
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


def hooks(rank: int, world: int, steps: int, width: int) -> dict[str, float]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = _Uniform(width)
    torch.manual_seed(0)
    plain, sharded = module.build_model(), module.build_model()
    mesh = init_device_mesh("cpu", (world,))
    for block in sharded:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
    x = torch.randn(8, width)
    times: dict[str, list[float]] = {"plain F": [], "plain B": [], "FSDP2 F": [], "FSDP2 B": [], "plain opt": [],
                                     "FSDP2 opt": []}
    optimizers = {"plain": torch.optim.AdamW(plain.parameters(), lr=1e-4),
                  "FSDP2": torch.optim.AdamW(sharded.parameters(), lr=1e-4)}
    for step in range(steps):
        for name, net in (("plain", plain), ("FSDP2", sharded)):
            torch.distributed.barrier()
            for i in range(4):
                last = i == 3
                if net is sharded:
                    net.set_requires_gradient_sync(last)
                    net.set_reshard_after_backward(last)
                    net.set_is_last_backward(last)
                t0 = time.perf_counter()
                out = net(x)
                t1 = time.perf_counter()
                out.square().mean().backward()
                t2 = time.perf_counter()
                if step >= 3 and 0 < i < 3:  # gathered already, no reduce-scatter after
                    times[f"{name} F"].append(t1 - t0)
                    times[f"{name} B"].append(t2 - t1)
            t3 = time.perf_counter()
            optimizers[name].step()
            times[f"{name} opt"].append(time.perf_counter() - t3)
            net.zero_grad()
    units = _Uniform.BLOCKS
    return {"forward": (_median_ms(times["FSDP2 F"]) - _median_ms(times["plain F"])) / units,
            "backward": (_median_ms(times["FSDP2 B"]) - _median_ms(times["plain B"])) / units,
            "optimizer": (_median_ms(times["FSDP2 opt"][3:]) - _median_ms(times["plain opt"][3:]) / world) / units}


def rank_main(rank: int, world: int, port: int, what: str, steps: int, queue: Any, width: int = 0) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if what == "wake":
            result = wake(rank, steps)
        elif what == "hooks":
            result = hooks(rank, world, steps, width)
        elif what.startswith("fsdp"):
            result = fsdp(rank, world, steps, width)
        else:
            result = ddp(rank, steps, what, width)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def run(what: str, world: int, steps: int, port: int, width: int = 0) -> dict[str, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, what, steps, queue, width)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join()
    return result


SIZE_HEADER = ["width", "run", "unit MiB", "alone (half batch)", "DDP sync", "FSDP2 forward, 1 rank",
               "FSDP2 forward, 2 ranks", "per all-gather", "FSDP2 backward, 1 rank", "FSDP2 backward, 2 ranks",
               "per reduce-scatter", "hooks per unit, forward", "hooks per unit, backward",
               "FSDP2's optimizer step per unit beyond half the plain one's"]


def widths(values: list[int], repeats: int, steps: int) -> list[list[Any]]:
    """Part 4: per width and run, DDP's sync (what it adds to the half batch alone) and what each FSDP2 unit's
    all-gather and reduce-scatter add beyond the half-batch compute."""
    rows, port = [], 29700
    for repeat in range(repeats):
        for width in values:
            port += 5
            alone = run("alone", 1, steps, port, width)["forward + backward"]
            synced = run("DDP", 2, steps, port + 1, width)["forward + backward"]
            one = run("fsdp", 1, steps, port + 2, width)
            two = run("fsdp", 2, steps, port + 3, width)
            units = int(two["units"])
            rows.append([width, repeat + 1, round(4 * (width * width + width) / 2**20, 3), round(alone, 2),
                         round(synced - alone, 2), round(one["forward"], 2), round(two["forward"], 2),
                         round((two["forward"] - one["forward"] / 2) / units, 3), round(one["backward"], 2),
                         round(two["backward"], 2), round((two["backward"] - one["backward"] / 2) / units, 3)])
            hook = run("hooks", 2, steps, port + 4, width)
            rows[-1] += [round(hook["forward"], 3), round(hook["backward"], 3), round(hook["optimizer"], 3)]
            print(rows[-1], flush=True)
    return rows


def fit_rows(rows: list[list[Any]]) -> list[list[Any]]:
    """ms = fixed + MiB x slope over the widths (medians of the runs): DDP's sync against the model's bytes, the
    FSDP2 collectives per unit against the unit's."""
    by_width: dict[int, list[list[Any]]] = {}
    for row in rows:
        by_width.setdefault(row[0], []).append(row)
    units = _Uniform.BLOCKS
    points = {"DDP all-reduce (per step)": [], "FSDP2 all-gather (per unit)": [],
              "FSDP2 reduce-scatter (per unit)": []}
    for group in by_width.values():
        mib = group[0][2]
        points["DDP all-reduce (per step)"].append((mib * units, statistics.median(r[4] for r in group)))
        points["FSDP2 all-gather (per unit)"].append((mib, statistics.median(r[7] for r in group)))
        points["FSDP2 reduce-scatter (per unit)"].append((mib, statistics.median(r[10] for r in group)))
    out = []
    if len(by_width) >= 2:  # a line needs two widths
        for name, xy in points.items():
            slope, fixed = statistics.linear_regression(*zip(*xy))
            out.append([name, round(fixed, 2), round(slope, 3), round(2**20 / (slope * 1e6), 2) if slope > 0 else "-"])
        hooks = [(group[0][2], statistics.median((r[11] + r[12]) / 2 for r in group)) for group in by_width.values()]
        slope, fixed = statistics.linear_regression(*zip(*hooks))
        out.append(["FSDP2 hooks per unit and action, gathered (mean of forward and backward)", round(fixed, 3),
                    round(slope, 4), "-"])
    out.append(["FSDP2's optimizer step per unit beyond half the plain one's (median)",
                f"{statistics.median(r[13] for r in rows):.3f}", "-", "-"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each measurement (one row each)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--widths", type=int, nargs="*", default=[256, 512, 1024, 1448],
                        help="part 4's block widths (unit bytes 4 W^2)")
    parser.add_argument("--only-widths", action="store_true", help="part 4 alone (prints; writes nothing)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    size_rows = widths(args.widths, args.repeats, args.steps)
    if args.only_widths:
        _results.show({"by unit size": _results.markdown_table(SIZE_HEADER, size_rows)})
        return

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
        "by unit size: 8 Linear(W, W) blocks, batch 32 over 2 ranks (median ms)": _results.markdown_table(
            SIZE_HEADER, size_rows),
        "by unit size: a fixed part and a rate, least squares over the widths' medians": _results.markdown_table(
            ["collective", "fixed ms (per unit, or per step for DDP)", "ms per MiB of the tensor",
             "GB/s of the tensor"], fit_rows(size_rows)),
    }
    if args.no_write:
        _results.show(tables)
        return
    notes = ("DDP's sync costs the step what its column adds to 'one rank alone' (all of it: on the CPU stand-in "
             "the bucket all-reduces take the rank's own time). autotune.simulate.COLLECTIVE_WAKE_CPU_MS reads these "
             "figures; COLLECTIVE_CPU_BANDWIDTH_BYTES_PER_S, LinkModel.all_gather_passes / reduce_scatter_passes "
             "(cpu) and SHARD_UNIT_OVERHEAD_CPU_MS read the last two tables.")
    _results.write("gloo_wake", title="What a gloo collective costs a CPU rank beyond its wire time",
                          device="cpu", tables=tables, data={"wake": wake_rows, "ddp": ddp_rows, "fsdp": fsdp_rows,
                                                            "sizes": size_rows},
                          notes=notes)


if __name__ == "__main__":
    main()
