"""A Hugging Face Llama, as it is: autotune cuts it at its decoder layers (embedding and norm + LM head are blocks of
their own) and gives every stage the attention mask, which pads some sequences here.

Needs `pip install "autotune[models]"` (transformers). No hub download: the config is built in code; for real
weights use LlamaForCausalLM.from_pretrained(...) in build_model. Scale to GPU size: HIDDEN = 4096, LAYERS = 32,
HEADS = 32, KV_HEADS = 8, INTERMEDIATE = 14336, VOCAB = 128256, SEQ_LEN = 4096, and --device cuda (Llama-3-8B).
"""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 512
SEQ_LEN = 32
HIDDEN = 64
LAYERS = 4
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 128


def build_model() -> nn.Module:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=SEQ_LEN)
    return LlamaForCausalLM(config)


def make_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(inputs as the model's forward takes them, next-token targets); every other sequence is right-padded."""
    generator = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=generator)
    mask = torch.ones(batch_size, SEQ_LEN, dtype=torch.long)
    mask[1::2, SEQ_LEN * 3 // 4 :] = 0
    targets = ids[:, 1:].clone()
    targets[mask == 0] = -100  # no loss on padding
    return {"input_ids": ids[:, :-1].contiguous(), "attention_mask": mask}, targets


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
