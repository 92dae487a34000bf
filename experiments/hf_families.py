"""Which Hugging Face *ForCausalLM families autotune.models cuts exactly (no adapter per family): for each, a tiny
config built in code, a padded attention mask, every 2-way cut's logits and gradients against the model's own.

    PYTHONPATH=$PWD python experiments/hf_families.py
"""

import warnings

import torch
import transformers
from torch import nn

from autotune.errors import ModelFileError
from autotune.models import check_cut, cut_model
from tests.models.helpers import assert_cuts_match

VOCAB = 96
LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
GPT_LIKE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_LIKE),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", LLAMA_LIKE),
    "Mistral": ("MistralConfig", "MistralForCausalLM", LLAMA_LIKE),
    "GPT2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4)),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", LLAMA_LIKE),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", LLAMA_LIKE),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", LLAMA_LIKE),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", LLAMA_LIKE),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", dict(LLAMA_LIKE, pad_token_id=0)),
    "Olmo2": ("Olmo2Config", "Olmo2ForCausalLM", LLAMA_LIKE),
    "StableLm": ("StableLmConfig", "StableLmForCausalLM", LLAMA_LIKE),
    "Starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", LLAMA_LIKE),
    "Cohere": ("CohereConfig", "CohereForCausalLM", LLAMA_LIKE),
    "Granite": ("GraniteConfig", "GraniteForCausalLM", LLAMA_LIKE),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", LLAMA_LIKE),
    "Qwen2Moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", LLAMA_LIKE),
    "GPTNeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                dict(GPT_LIKE, intermediate_size=64, max_position_embeddings=64)),
    "Falcon": ("FalconConfig", "FalconForCausalLM", dict(GPT_LIKE, max_position_embeddings=64)),
    "Phi": ("PhiConfig", "PhiForCausalLM", dict(GPT_LIKE, intermediate_size=64, max_position_embeddings=64)),
    "GPTJ": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, rotary_dim=4)),
    "CodeGen": ("CodeGenConfig", "CodeGenForCausalLM", dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4,
                                                            rotary_dim=4)),
    "Bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4)),
    "MPT": ("MptConfig", "MptForCausalLM", dict(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4)),
    "GPTNeo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=4,
                                                         attention_types=[[["global", "local"], 1], [["global"], 1]])),
    "OPT": ("OPTConfig", "OPTForCausalLM", dict(GPT_LIKE, ffn_dim=64, word_embed_proj_dim=32)),
}


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


def main() -> None:
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, 8:] = 0
    targets = torch.randint(0, VOCAB, (3, 12), generator=g)
    targets[mask == 0] = -100
    inputs = {"input_ids": ids, "attention_mask": mask}
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name, (config_name, model_name, kwargs) in FAMILIES.items():
        try:
            torch.manual_seed(0)
            net = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).train()
            for module in net.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.0
            model = cut_model(net)
            check_cut(model, inputs)
            cuts = assert_cuts_match(model, inputs, loss_fn, targets, three_way=False, rtol=1e-5, atol=1e-5)
            print(f"{name:11s} exact ({cuts} cuts)  {model.family}: {model.names[0]} | {model.n_blocks - 2} layers | "
                  f"{model.names[-1]}; tied: {len(model.shared_parameters())}")
        except ModelFileError as exc:
            print(f"{name:11s} refused: {exc}")
        except Exception as exc:  # noqa: BLE001 - a survey: report and go on
            print(f"{name:11s} FAILED: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")


if __name__ == "__main__":
    main()
