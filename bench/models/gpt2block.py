"""A 2-block GPT: token embedding, two pre-norm attention blocks, norm + head, a 256-token vocabulary and 64-token
sequences, so attention's (sequence x sequence) temporaries and the cross-entropy over the vocabulary both show
(recipes/gpt.py at other sizes)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _recipe import recipe  # noqa: E402

_model = recipe("gpt.py", VOCAB=256, SEQ_LEN=64, N_BLOCKS=2)
build_model, make_batch, loss_fn = _model["build_model"], _model["make_batch"], _model["loss_fn"]
