"""Seven layers, the heavy ones last (a tail-heavy MLP with millisecond steps): the last stage holds most of the
parameters, activations and loss (recipes/mlp.py at other widths)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _recipe import recipe  # noqa: E402

_model = recipe("mlp.py", IN_FEATURES=64, WIDTHS=[64, 64, 128, 256, 1024, 1024])
build_model, make_batch, loss_fn = _model["build_model"], _model["make_batch"], _model["loss_fn"]
