"""recipes/gpt.py at a size a GPU does work on (~170 M parameters: 8 blocks of width 1024, 512 tokens, a 32 k
vocabulary), for CUDA calibration runs (bench/cuda_first_run.py); on the CPU stand-in a step takes seconds."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _recipe import recipe  # noqa: E402

_model = recipe("gpt.py", VOCAB=32768, SEQ_LEN=512, D_MODEL=1024, N_HEADS=16, N_BLOCKS=8)
build_model, make_batch, loss_fn = _model["build_model"], _model["make_batch"], _model["loss_fn"]
