"""A 13-layer MLP of even width (12 hidden blocks of 256 + a head): each pipeline hand-off is one 256-wide
activation, so a slow inter-node link shows in the step time (bench/internode.py; recipes/mlp.py at these widths)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _recipe import recipe  # noqa: E402

WIDTH = 256
_model = recipe("mlp.py", IN_FEATURES=WIDTH, WIDTHS=[WIDTH] * 12, N_CLASSES=10)
build_model, make_batch, loss_fn = _model["build_model"], _model["make_batch"], _model["loss_fn"]
build_optimizer = _model["build_optimizer"]
