"""A Hugging Face BERT trained on masked-language modelling, as it is: autotune cuts it at its encoder layers (the
embeddings and the MLM head are blocks of their own) and gives every stage the attention mask, which pads some
sequences here. Its word embedding is tied to the MLM head's decoder: one parameter, whichever ranks hold the two.
RoBERTa, XLM-R, ELECTRA, DistilBERT and DeBERTa-v2 models (*ForMaskedLM, *ForSequenceClassification,
*ForTokenClassification) are cut the same way.

Needs `pip install "autotune[models]"` (transformers). No hub download: the config is built in code; for real
weights use BertForMaskedLM.from_pretrained(...) in build_model. Scale to GPU size (BERT-large): HIDDEN = 1024,
LAYERS = 24, HEADS = 16, INTERMEDIATE = 4096, VOCAB = 30522, SEQ_LEN = 512, and --device cuda.
"""

import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM

VOCAB = 512
SEQ_LEN = 32
HIDDEN = 64
LAYERS = 4
HEADS = 4
INTERMEDIATE = 128
MASK_ID = 3
MASKED = 0.15


def build_model() -> nn.Module:
    config = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=INTERMEDIATE, max_position_embeddings=SEQ_LEN)
    return BertForMaskedLM(config)


def make_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(inputs as the model's forward takes them, the original tokens where MASK_ID replaced them, -100 elsewhere);
    every other sequence is right-padded."""
    generator = torch.Generator().manual_seed(batch_size)
    tokens = torch.randint(MASK_ID + 1, VOCAB, (batch_size, SEQ_LEN), generator=generator)
    mask = torch.ones(batch_size, SEQ_LEN, dtype=torch.long)
    mask[1::2, SEQ_LEN * 3 // 4 :] = 0
    hidden = (torch.rand(batch_size, SEQ_LEN, generator=generator) < MASKED) & (mask == 1)
    hidden[:, 0] = True  # at least one prediction per sequence
    targets = torch.where(hidden, tokens, torch.full_like(tokens, -100))
    ids = torch.where(hidden, torch.full_like(tokens, MASK_ID), tokens)
    return {"input_ids": ids, "attention_mask": mask}, targets


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
