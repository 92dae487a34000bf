"""How much each term of the memory model moves the peak-memory error: re-predicts the configurations a memory-only
calibration measured (bench/results/calibration_memory.json: its profiles and measured peaks) with the whole model,
with each term left out in turn, and with all of them left out (the model before issue 24).

    python bench/memory_terms.py            # after: python bench/calibrate.py ... --memory-only --name calibration_memory
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

import autotune.simulate as sim  # noqa: E402
from autotune.candidate import Candidate  # noqa: E402
from autotune.costs import Profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _proportional(*args: Any, per_tensor: bool, **kwargs: Any) -> float:
    return ORIGINAL["optimizer_step_bytes"](*args, per_tensor=False, **kwargs)


ORIGINAL = {name: getattr(sim, name) for name in
            ("batch_bytes", "loss_backward_bytes", "layer_backward_bytes", "split_kept_bytes",
             "sends_kept_to_the_end", "sent_bytes", "optimizer_step_bytes")}
TERMS: dict[str, dict[str, Callable[..., Any]]] = {
    "sent tensors kept to the end": {"sends_kept_to_the_end": lambda schedule: False,
                                     "sent_bytes": lambda *a, **k: (0.0, 0.0)},
    "loss backward (2 x output)": {"loss_backward_bytes": _zero},
    "layer backward (weight, input, output grads)": {"layer_backward_bytes": _zero},
    "split I keeps for W": {"split_kept_bytes": _zero},
    "optimizer per tensor (CPU)": {"optimizer_step_bytes": _proportional},
    "the batch's inputs": {"batch_bytes": _zero},
}


@contextlib.contextmanager
def without(*terms: str) -> Iterator[None]:
    for term in terms:
        for name, fn in TERMS[term].items():
            setattr(sim, name, fn)
    try:
        yield
    finally:
        for name, fn in ORIGINAL.items():
            setattr(sim, name, fn)


def errors(results: list[dict[str, Any]]) -> list[float]:
    out = []
    for r in results:
        profile = Profile.from_dict(r["profile"])
        for row in r["rows"]:
            c = Candidate.from_dict(row["candidate_dict"])
            predicted = max(sim.simulate(profile, c, with_timeline=False).peak_memory_bytes)
            out.append((predicted - row["measured_peak"]) / row["measured_peak"])
    return out


def summary(errs: list[float]) -> list[Any]:
    return [f"{statistics.fmean(abs(e) for e in errs):.1%}", f"{min(errs):+.1%}", f"{max(errs):+.1%}",
            sum(abs(e) > 0.05 for e in errs)]


def main() -> None:
    data = json.loads((ROOT / "bench" / "results" / "calibration_memory.json").read_text())
    results = data["results"]
    header = ["model", "variant", "MAPE", "worst under", "worst over", "configs off by > 5 %"]
    rows = []
    for r in [*results, None]:
        subset = results if r is None else [r]
        name = "all models" if r is None else Path(r["recipe"]).stem
        with without():
            rows.append([name, "the whole model", *summary(errors(subset))])
        for term in TERMS:
            with without(term):
                rows.append([name, f"without: {term}", *summary(errors(subset))])
        with without(*TERMS):
            rows.append([name, "without all (the model before)", *summary(errors(subset))])
    _results.write("memory_terms", title="Peak memory: what each term of the model moves", device="cpu",
                   tables={"peak-memory error per variant (predicted vs measured, most loaded rank)":
                           _results.markdown_table(header, rows)},
                   data={"rows": rows, "source": data.get("command")})


if __name__ == "__main__":
    main()
