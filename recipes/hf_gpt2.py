"""A Hugging Face GPT-2, as it is. Its token embedding is tied to the LM head: autotune trains that one parameter as
one, whichever ranks hold the embedding and the head.

Needs `pip install "autotune[models]"` (transformers). Scale to GPU size (GPT-2 XL): N_EMBD = 1600, N_LAYER = 48,
N_HEAD = 25, VOCAB = 50257, SEQ_LEN = 1024, and --device cuda.
"""

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 512
SEQ_LEN = 32
N_EMBD = 64
N_LAYER = 4
N_HEAD = 4


def build_model() -> nn.Module:
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=N_EMBD, n_layer=N_LAYER, n_head=N_HEAD,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
