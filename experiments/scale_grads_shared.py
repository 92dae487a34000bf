"""What torch's scale_grads=True does to a parameter held by two stages on one rank (ZBV puts stage 0 and stage
2p-1 on rank 0; a tied GPT-2 then has wte in both). One process, two stages, torch 2.13 / 2.14.

Finding: each stage divides all of its parameters' gradients by n_microbatches at its own last backward
(stage.py `scale_grads`, called from schedules.py when `backward_counter[stage] == n_microbatches`). A shared
parameter is divided once per stage, and the first division also hits whatever the other stage had accumulated so
far, so the result depends on the order of the backwards:
    Interleaved1F1B, ZBVZeroBubble: (head all + emb mb 0..n-2) / n^2 + emb mb n-1 / n
    LoopedBFS:                       head all / n^2 + emb all / n
The fix: scale_grads=False, then divide each unique parameter's gradient once by n_microbatches.

    python experiments/scale_grads_shared.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules

V, H, B, T, N = 11, 8, 8, 5, 4
torch.manual_seed(0)
emb, mid, head = nn.Embedding(V, H), nn.Linear(H, H), nn.Linear(H, V, bias=False)
head.weight = emb.weight  # tied
ids, tgt = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid = emb, mid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(self.emb(x)))


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)


def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, V), t.reshape(-1))


def contributions(stage: int) -> list[torch.Tensor]:
    """The tied gradient each micro-batch's loss puts on wte through one stage only (not yet scaled)."""
    out = []
    for i, t in zip(ids.chunk(N), tgt.chunk(N)):
        emb.weight.grad = None
        e = emb(i) if stage == 0 else emb(i).detach()
        logits = nn.functional.linear(torch.tanh(mid(e)), emb.weight if stage == 1 else emb.weight.detach())
        loss_fn(logits, t).backward()
        out.append(emb.weight.grad.clone())
    return out


def main() -> None:
    from_emb, from_head = contributions(0), contributions(1)
    reference = (sum(from_emb) + sum(from_head)) / N
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 300))
    dist.init_process_group("gloo", rank=0, world_size=1)
    for name in ("Interleaved1F1B", "ZBVZeroBubble", "LoopedBFS"):
        for scale_grads in (True, False):
            for p in (emb.weight, mid.weight, mid.bias):
                p.grad = None
            cpu = torch.device("cpu")
            stages = [PipelineStage(First(), 0, 2, cpu), PipelineStage(Last(), 1, 2, cpu)]
            cls = getattr(schedules, f"Schedule{name}")
            cls(stages, n_microbatches=N, loss_fn=loss_fn, scale_grads=scale_grads).step(ids, target=tgt)
            got = emb.weight.grad
            if not scale_grads:
                unique = {id(p): p for s in stages for p in s.submod.parameters()}.values()
                for p in unique:
                    p.grad.div_(N)
                print(f"{name:16s} scale_grads=False, divided once per parameter: equals the reference "
                      f"{torch.allclose(got, reference, atol=1e-7)}")
                continue
            models = {
                "reference (sum / n)": reference,
                "divided twice (sum / n^2)": reference / N,
                "(head all + emb mb 0..n-2) / n^2 + emb mb n-1 / n": (sum(from_head) + sum(from_emb[:-1])) / N**2
                + from_emb[-1] / N,
                "head all / n^2 + emb all / n": sum(from_head) / N**2 + sum(from_emb) / N,
            }
            match = [label for label, value in models.items() if torch.allclose(got, value, atol=1e-7)]
            print(f"{name:16s} scale_grads=True: tied gradient = {match or 'none of the models'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
