"""Planner speed: `plan()` on synthetic transformer-like profiles (simulation only, no trial), the whole
`autotune plan` command (import, model check, profiling, planning) on a 96-layer model file over 1024 GPUs, and
`autotune plan --profile P --nodes 128 --gpus-per-node 8` on a saved 96-layer profile (no model, no profiling).

    python bench/plan_speed.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from autotune.costs import LayerCost, Profile  # noqa: E402
from autotune.plan import plan  # noqa: E402

GiB = 2**30


def transformer_profile(n_layers: int, *, micro_batch_size: int = 1) -> Profile:
    """An embedding, n-2 equal blocks and a head: per micro-batch of one 4k-token sequence of a ~7B model on an H100."""
    block = LayerCost(forward_ms=4.0, backward_input_ms=4.0, backward_weight_ms=4.0, saved_bytes=2 * GiB,
                      output_bytes=32 * 2**20, parameter_bytes=400 * 2**20)
    embed = LayerCost(forward_ms=0.5, backward_input_ms=0.0, backward_weight_ms=0.5, saved_bytes=64 * 2**20,
                      output_bytes=32 * 2**20, parameter_bytes=500 * 2**20)
    head = LayerCost(forward_ms=6.0, backward_input_ms=6.0, backward_weight_ms=6.0, saved_bytes=3 * GiB,
                     output_bytes=4 * 2**20, parameter_bytes=500 * 2**20)
    return Profile.from_layer_costs([embed, *[block] * (n_layers - 2), head], micro_batch_size=micro_batch_size,
                                    input_bytes=32 * 2**10, device="cuda")


def time_plan(n_layers: int, gpus: int, batch_size: int, limit: int | None) -> tuple[float, int]:
    profile = transformer_profile(n_layers)
    started = time.perf_counter()
    planned = plan(profile, gpus=gpus, batch_size=batch_size, memory_limit_bytes=limit)
    return time.perf_counter() - started, len(planned)


MODEL_96 = textwrap.dedent("""
    import torch
    from torch import nn

    def build_model():
        # LayerNorm keeps activations at unit scale: in a deep plain MLP they decay into subnormal floats, which the
        # CPU computes 10-100x slower, so "identical" layers 17-37 profiled (and ran) far slower than the rest.
        return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()) for _ in range(96)])

    def make_batch(batch_size):
        return torch.randn(batch_size, 64), torch.randn(batch_size, 64)

    def loss_fn(output, target):
        return nn.functional.mse_loss(output, target)
""")


def time_plan_command(gpus: int, batch: int) -> float:
    """Wall time of `autotune plan` on 96 identical layers, profiling included."""
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "layers96.py"
        model.write_text(MODEL_96)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "autotune", "plan", str(model), "--gpus", str(gpus), "--batch-size",
                        str(batch), "--device", "cpu", "--json"], check=True, capture_output=True)
        return time.perf_counter() - started


def time_plan_profile_command(layers: int, batch: int, where: list[str]) -> float:
    """Wall time of `autotune plan --profile P ...` on the synthetic profile saved as JSON (as `autotune profile
    --output` writes it): import, planning, printing the top 3."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"profile{layers}.json"
        data = transformer_profile(layers).to_dict()
        data["batch_size"] = batch
        path.write_text(json.dumps(data))
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "autotune", "plan", "--profile", str(path), *where, "--memory-limit",
                        "80GiB", "--top", "3"], check=True, capture_output=True)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    cases = [(48, 8, 256, 80 * GiB, 10.0), (96, 1024, 2048, 80 * GiB, 10.0)]
    rows = []
    for n_layers, gpus, batch, limit, target in cases:
        seconds, n = time_plan(n_layers, gpus, batch, limit)
        rows.append([n_layers, gpus, batch, "80 GiB", n, seconds, f"< {target:g} s",
                     "met" if seconds < target else "missed"])
    command_rows = [[96, 1024, 4096, time_plan_command(1024, 4096)]]
    profile_rows = []
    for where in (["--gpus", "1024"], ["--nodes", "128", "--gpus-per-node", "8"]):
        seconds = time_plan_profile_command(96, 2048, where)
        profile_rows.append([" ".join(where), seconds, "< 10 s", "met" if seconds < 10 else "missed"])
    _results.write(
        "plan_speed", title="Planner speed", device="cpu",
        tables={
            "plan() wall time, one process (synthetic profile: planning alone)": _results.markdown_table(
                ["layers", "GPUs", "batch", "memory limit", "candidates kept", "seconds", "target", "status"], rows),
            "`autotune plan` end to end (96 Linear+LayerNorm+GELU layers of width 64, profiled on the CPU)":
                _results.markdown_table(["layers", "GPUs", "batch", "seconds"], command_rows),
            "`autotune plan --profile P` end to end (the synthetic 96-layer profile, batch 2048, 80 GiB)":
                _results.markdown_table(["ranks", "seconds", "target", "status"], profile_rows),
        },
        data={"rows": rows, "command_rows": command_rows, "profile_rows": profile_rows},
        notes="The first table times `plan()` on synthetic profiles (an embedding, equal blocks, a head), so the time "
              "is planning alone. The second runs the command: importing torch, checking the model, profiling only "
              "the micro-batch sizes a candidate can use (up to 256 here), and planning. The third plans from a saved "
              "profile, as a user planning a cluster run on a laptop does; over nodes it also weighs both rank "
              "orders of each pp x dp layout.",
    )


if __name__ == "__main__":
    main()
