"""Six layers whose costs spread ~10x, the heavy ones first: small enough for an exhaustive grid on 2 cores
(recipes/mlp.py at other widths)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _recipe import recipe  # noqa: E402

_model = recipe("mlp.py", IN_FEATURES=256, WIDTHS=[1024, 1024, 256, 64, 64])
build_model, make_batch, loss_fn = _model["build_model"], _model["make_batch"], _model["loss_fn"]
