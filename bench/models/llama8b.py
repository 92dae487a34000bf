"""recipes/hf_llama.py at Llama-3-8B's shape (LlamaConfig only, no hub download: 8.0 B parameters, 32 decoder layers,
a 128 k vocabulary, 4096-token sequences), for a GPU run of issue 29: profile it on one GPU, block by block, and plan
it for 8 (bench/cuda_first_run.sh runs both). Its whole training state (~128 GB in bf16 with AdamW) fits no one GPU."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _recipe import recipe  # noqa: E402

_model = recipe("hf_llama.py", HIDDEN=4096, LAYERS=32, HEADS=32, KV_HEADS=8, INTERMEDIATE=14336, VOCAB=128256,
                SEQ_LEN=4096)
build_model, make_batch, loss_fn = _model["build_model"], _model["make_batch"], _model["loss_fn"]
