"""Train with a tuned config: the few lines a training script needs.

    autotune search recipes/mlp.py --gpus 2 --device cpu --batch-size 256 --trials 12 --output tuned.yaml
    torchrun --standalone --nproc-per-node 2 recipes/train_with_config.py tuned.yaml --steps 20 --device cpu

Every rank builds the model from the same seed, keeps the stages the config gives it and runs the tuned schedule;
data-parallel replicas average their gradients. The last pipeline rank prints the loss.
"""

import argparse

import torch
import torch.distributed as dist

from autotune.model_file import make_batch
from autotune.runtime import setup_pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--model", default=None, help="default: the config's model path")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    args = parser.parse_args()

    if args.device == "cpu":
        torch.set_num_threads(1)
    pipe = setup_pipeline(args.config, args.model, device=args.device)
    for step in range(args.steps):
        inputs, targets = make_batch(pipe.spec, pipe.candidate.global_batch_size)  # your data loader goes here
        losses = pipe.step(inputs, targets)
        if losses:
            print(f"rank {dist.get_rank()} step {step} loss {torch.stack(losses).mean().item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
