"""One Hugging Face Llama decoder layer, forward + backward, whole (tp 1, one process) and split over tp 2 ranks with
the model's own plan (autotune.models.tensor_parallel): median time per micro-batch and parameter bytes per rank.

    python bench/tp_block.py --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 --seq 32 --batch 2
    python bench/tp_block.py --hidden 1024 --heads 16 --kv-heads 8 --intermediate 2816 --seq 256 --batch 2

CPU stand-in (gloo, one thread per rank): the times are not a GPU's, and on a shared machine they are noise; the
bytes are exact. It prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

MODEL = """
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 256, {seq}

def build_model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size={hidden}, intermediate_size={intermediate},
                                        num_hidden_layers=1, num_attention_heads={heads},
                                        num_key_value_heads={kv_heads}, max_position_embeddings=SEQ))

def make_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return {{"input_ids": ids[:, :-1].contiguous()}}, ids[:, 1:].contiguous()

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
"""


def measure(rank: int, world: int, args: argparse.Namespace, path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from autotune.model_file import build_blocks, load_model_file, make_batch
    from autotune.models.tensor_parallel import apply_tp, tp_plan_of

    torch.set_num_threads(1)
    spec = load_model_file(path)
    blocks = build_blocks(spec, only=[0, 1])  # the embedding (to make the layer's input) and the one layer
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", store=dist.FileStore(f"{out}.store", world), rank=rank, world_size=world)
        plan, why = tp_plan_of(spec)
        if plan is None:
            raise SystemExit(why)
        apply_tp(blocks, 1, 2, plan, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    inputs, _ = make_batch(spec, args.batch)
    first, side = blocks.split_inputs(inputs)
    with torch.no_grad():
        hidden = blocks.stage(0, 1)(*first, **side)
    layer = blocks.stage(1, 2)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in layer.parameters()]
    times = []
    for _ in range(args.warmup + args.steps):
        x = hidden.clone().requires_grad_(True)
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        layer(x, **side).float().pow(2).mean().backward()
        times.append(time.perf_counter() - start)
        for p in layer.parameters():
            p.grad = None
    result = {"rank": rank, "ms": statistics.median(times[args.warmup :]) * 1e3,
              "parameter_bytes": sum(t.numel() * t.element_size() for t in local)}
    Path(f"{out}.{world}.{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 64), ("heads", 4), ("kv-heads", 2), ("intermediate", 128), ("seq", 32),
                          ("batch", 2), ("steps", 20), ("warmup", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tp-block-"))
    path = folder / "llama.py"
    path.write_text(MODEL.format(seq=args.seq, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
                                 kv_heads=args.kv_heads))
    out = str(folder / "result")
    context = multiprocessing.get_context("spawn")
    for world in (1, 2):
        ranks = [context.Process(target=measure, args=(r, world, args, str(path), out)) for r in range(world)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join()
    one = json.loads(Path(f"{out}.1.0.json").read_text())
    two = [json.loads(Path(f"{out}.2.{r}.json").read_text()) for r in range(2)]
    print(json.dumps({
        "shape": vars(args),
        "tp1": {"ms": round(one["ms"], 3), "parameter_bytes": one["parameter_bytes"]},
        "tp2": {"ms": [round(r["ms"], 3) for r in two], "parameter_bytes": [r["parameter_bytes"] for r in two]},
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }))


if __name__ == "__main__":
    main()
