"""Rank body for the DeepSpeed export test: the exported JSON and PipelineModule code, one train_batch per config."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def run(rank: int, world_size: int, model: str, exports: list[str], out_dir: str) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        store = dist.FileStore(str(Path(out_dir) / "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        from autotune.model_file import load_model_file

        spec = load_model_file(model)
        results = []
        for text in exports:
            config = json.loads(text)
            namespace: dict = {}
            exec("\n".join(config["_autotune_pipeline_module"]), namespace)  # the export's code, as a user runs it
            dual = "TunedDualPipeVModule" in namespace
            cls = namespace["TunedDualPipeVModule" if dual else "TunedPipelineModule"]
            torch.manual_seed(0)
            pipe = cls(layers=list(spec.build_model()), num_stages=world_size, loss_fn=spec.loss_fn)
            engine, _, _, _ = deepspeed.initialize(
                model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.01), config=config
            )
            micro = config["train_micro_batch_size_per_gpu"]
            batches = [spec.make_batch(micro) for _ in range(config["gradient_accumulation_steps"])]
            loss = engine.train_batch(data_iter=iter(batches))
            bounds = list(pipe.phase_bounds) if dual else [(pipe._local_start, pipe._local_stop)]
            results.append(
                {
                    "parts": list(pipe.parts),
                    "bounds": [list(b) for b in bounds],
                    "loss": float(loss),
                    "engine": type(engine).__name__,
                    "checkpoint_interval": pipe.activation_checkpoint_interval,
                    "checkpoint_func": getattr(pipe.activation_checkpoint_func, "__name__", ""),
                }
            )
        (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
