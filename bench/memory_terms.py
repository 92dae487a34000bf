"""How much each term of the memory model moves the peak-memory error: re-predicts the configurations a memory-only
calibration measured (bench/results/calibration_memory.json: its profiles and measured peaks) with the whole model,
with each term left out in turn, and with all of them left out (the model before issue 24).

    python bench/memory_terms.py --before DIR   # after: bench/calibrate.py ... --memory-only --name calibration_memory

--before DIR re-predicts with another copy of the package too (the model before issue 24:
git archive fafcb52 autotune | tar -x -C DIR), in a subprocess with DIR first on its path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
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
NOTES = """
"without: X" re-predicts with that one term left out and everything else kept; "without all six" leaves out the six
terms above but keeps the other corrections (a hand-off inside a rank is no send, the loss's saves kept under
checkpointing and let go of by an I, the first stage's saved input is the batch's), so it is not exactly the model
before issue 24: that is the row "the model before", the package at commit fafcb52 on the same measurements.

What the terms are (memory_model.py), as bench/memory_breakdown.py traced them:
- sent tensors kept to the end: torch's send works hold their tensor until waited; ScheduleGPipe and the runtime of
  the multi-stage schedules wait for every send when the pipeline ends (recipes/gpt.py, Interleaved1F1B m16: 42
  outputs and gradients of 64 KiB alive at rank 0's peak, 2.75 of 16.8 MB); 1F1B waits each before the next.
- loss backward: cross-entropy's gradients of the log-probabilities and of the logits, 2 x the model output.
- layer backward: a backward's fresh weight gradients (added into .grad from the second micro-batch on) and the
  gradient of a layer's input and output.
- split I keeps for W: the gradients of the weight ops' outputs that stage_backward_input keeps in param_groups.
- optimizer per tensor: on CPU torch's AdamW steps one tensor at a time (no foreach): its temporaries are 2 x the
  largest tensor (sqrt, division), not a share of all parameters (tail-heavy MLP: 8.4 MB = 2 x 4 MiB).
- the batch's inputs: every rank of a trial holds the global batch.
"""


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


BEFORE = """
import json, sys
from autotune.candidate import Candidate
from autotune.costs import Profile
from autotune.simulate import simulate
out = {}
for r in json.load(open(sys.argv[1]))["results"]:
    prof = Profile.from_dict(r["profile"])
    out[r["recipe"]] = [(max(simulate(prof, Candidate.from_dict(x["candidate_dict"]), with_timeline=False)
                             .peak_memory_bytes) - x["measured_peak"]) / x["measured_peak"] for x in r["rows"]]
print(json.dumps(out))
"""


def errors_before(package_dir: str, results_path: Path) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(package_dir)}
    done = subprocess.run([sys.executable, "-c", BEFORE, str(results_path.resolve())], env=env, cwd=package_dir,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def summary(errs: list[float]) -> list[Any]:
    return [f"{statistics.fmean(abs(e) for e in errs):.1%}", f"{min(errs):+.1%}", f"{max(errs):+.1%}",
            sum(abs(e) > 0.05 for e in errs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a copy of the autotune package to compare with (its parent folder)")
    args = parser.parse_args()
    path = ROOT / "bench" / "results" / "calibration_memory.json"
    data = json.loads(path.read_text())
    results = data["results"]
    before = errors_before(args.before, path) if args.before else None
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
            rows.append([name, "without all six", *summary(errors(subset))])
        if before is not None:
            errs = [e for x in subset for e in before[x["recipe"]]]
            rows.append([name, "the model before (--before)", *summary(errs)])
    _results.write("memory_terms", title="Peak memory: what each term of the model moves", device="cpu",
                   tables={"peak-memory error per variant (predicted vs measured, most loaded rank)":
                           _results.markdown_table(header, rows)},
                   data={"rows": rows, "source": data.get("command")}, notes=NOTES)


if __name__ == "__main__":
    main()
