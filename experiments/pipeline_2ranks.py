"""Stage A sanity check on real torch pipelining (not a test): cut a Hugging Face model with autotune.models, run it
on 2 gloo ranks with a torch schedule, side inputs as step() kwargs, tied weight summed over the ranks holding it
(scale_grads=False, then each unique parameter divided once by n_microbatches), and compare every gradient with
the unpipelined model.

    PYTHONPATH=$PWD python experiments/pipeline_2ranks.py gpt2 1F1B
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules

from autotune.models import cut_model, shared_groups, shared_parameter_ranks

VOCAB, SEQ, B, N_MB = 96, 10, 8, 4


class Skip(nn.Module):
    """A value made by the embedding and used after the last layer: two tensors cross every boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h0 = self.embed(input_ids)
        h = h0
        for layer in self.layers:
            h = torch.tanh(layer(h)) * attention_mask[..., None]
        return self.head(h + h0)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "skip":
        return Skip()
    import transformers

    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    mask = torch.ones(B, SEQ, dtype=torch.long)
    mask[1, :3] = 0
    mask[6, 7:] = 0
    targets = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    targets[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask}, targets


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


def run(rank: int, name: str, schedule: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    net = build(name).train()
    inputs, targets = batch()
    model = cut_model(net, inputs=inputs)
    args, side = model.split_inputs(inputs)
    multi = schedule in ("Interleaved1F1B", "ZBVZeroBubble")
    n_stages = 4 if multi else 2
    bounds = [0, 2, 3, 5, model.n_blocks] if multi else [0, 3, model.n_blocks]
    placement = [0, 1, 1, 0] if schedule == "ZBVZeroBubble" else [s % 2 for s in range(n_stages)]
    mine = [s for s in range(n_stages) if placement[s] == rank]
    modules = [model.stage(bounds[s], bounds[s + 1]) for s in mine]
    stages = [PipelineStage(m, s, n_stages, torch.device("cpu")) for m, s in zip(modules, mine)]
    cls = getattr(schedules, f"Schedule{schedule}")
    sched = cls(stages if multi else stages[0], n_microbatches=N_MB, loss_fn=loss_fn, scale_grads=False)
    holds_first, holds_last = 0 in mine, n_stages - 1 in mine
    step_args = args if holds_first else ()
    if holds_last:
        sched.step(*step_args, target=targets, **side)
    else:
        sched.step(*step_args, **side)
    params = list({id(p): p for m in modules for p in m.parameters()}.values())  # one entry per parameter
    for p in params:
        if p.grad is not None:
            p.grad.div_(N_MB)
    layers_per_stage = [bounds[s + 1] - bounds[s] for s in range(n_stages)]
    shared = model.shared_parameters()
    ranks = shared_parameter_ranks(shared, layers_per_stage, placement)
    groups = {r: dist.new_group(list(r)) for r in shared_groups(ranks)}
    for parameter, holders in zip(shared, ranks):
        if len(holders) > 1 and rank in holders:
            p = net.get_parameter(parameter.names[0])
            dist.all_reduce(p.grad, group=groups[holders])
    # Reference on every rank: the model's own forward on the whole batch, loss averaged over micro-batches.
    ref = build(name).train()
    reference = cut_model(ref, inputs=inputs).reference  # the model's own forward (HF: its .logits)
    mb = B // N_MB
    total = sum(loss_fn(reference({k: v[i * mb:(i + 1) * mb] for k, v in inputs.items()}),
                        targets[i * mb:(i + 1) * mb]) for i in range(N_MB)) / N_MB
    total.backward()
    want = dict(ref.named_parameters())
    checked = 0
    for pname, p in net.named_parameters():
        if any(p is q for q in params):
            torch.testing.assert_close(p.grad, want[pname].grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, where=pname: f"{where}: {m}")
            checked += 1
    print(f"rank {rank} {name} {schedule}: stages {mine}, {checked} parameters equal the reference; shared {ranks}",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    name, schedule = sys.argv[1], sys.argv[2]
    mp.spawn(run, args=(name, schedule, 29500 + os.getpid() % 1000), nprocs=2)
