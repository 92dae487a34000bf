"""How much each term of the memory model moves the peak-memory error: re-predicts the configurations a memory-only
calibration measured (bench/results/calibration_memory.json: its profiles and measured peaks) with the whole model,
with each term left out in turn, and with all of them left out.

    python bench/memory_terms.py --before DIR   # after: bench/calibrate.py ... --memory-only --name calibration_memory

--before DIR re-predicts with another copy of the package too (an earlier model: git archive COMMIT autotune |
tar -x -C DIR), in a subprocess with DIR first on its path; it reads the same profiles (what it does not know of
them, it ignores).
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
"without: X" re-predicts with that one term left out and everything else kept; "without all" leaves out every term
above but keeps the other corrections (a hand-off inside a rank is no send, the loss's saves kept under
checkpointing and let go of by an I), so it is not exactly an earlier model: that is the row "the model before",
the package given to --before on the same measurements.

What the terms are (memory_model.py), as bench/memory_breakdown.py traced them:
- sent tensors kept to the end: torch's send works hold their tensor until waited; ScheduleGPipe and the runtime of
  the multi-stage schedules wait for every send when the pipeline ends (recipes/gpt.py, Interleaved1F1B m16: 42
  outputs and gradients of 64 KiB alive at rank 0's peak, 2.75 of 16.8 MB); 1F1B waits each before the next.
- loss backward: cross-entropy's gradients of the log-probabilities and of the logits, 2 x the model output.
- layer backward: what a layer's backward holds at most (profiled: its temporaries, such as an MLP's hidden
  gradient, and its input and weight gradients, less the saved activations it lets go of), with its output's
  gradient where a later layer made it, less what the later layers let go of.
- split I: what torch's stage_backward_input holds at most and keeps for its W (profiled per layer).
- optimizer per tensor: on CPU torch's AdamW steps one tensor at a time (no foreach): its temporaries are 2 x the
  largest tensor (sqrt, division), not a share of all parameters (tail-heavy MLP: 8.4 MB = 2 x 4 MiB).
- the batch: the inputs on the first stage's rank, the targets on the last's.
- boundary tensors counted once: a stage's saved input that is its receive buffer (or the batch), and its saved
  output that is the output it sends.
- gradients from the first backward: torch lets the gradients go after each step; a stage makes them again in its
  first backward (one replica, unsharded).
"""


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _proportional(*args: Any, per_tensor: bool, **kwargs: Any) -> float:
    return ORIGINAL["optimizer_step_bytes"](*args, per_tensor=False, **kwargs)


def _nothing_kept(*args: Any, **kwargs: Any) -> tuple[int, int]:
    return 0, 0


ORIGINAL = {name: getattr(sim, name) for name in
            ("batch_bytes", "loss_backward_bytes", "layer_backward_bytes", "split_kept_bytes", "input_backward_bytes",
             "sends_kept_to_the_end", "sent_bytes", "optimizer_step_bytes", "input_held_elsewhere_bytes",
             "output_saved_bytes", "gradients_made_in_step")}
TERMS: dict[str, dict[str, Callable[..., Any]]] = {
    "sent tensors kept to the end": {"sends_kept_to_the_end": lambda schedule: False,
                                     "sent_bytes": lambda *a, **k: (0.0, 0.0)},
    "loss backward (2 x output)": {"loss_backward_bytes": _zero},
    "layer backward (profiled peaks)": {"layer_backward_bytes": _zero},
    "split I (profiled: its peak, what it keeps for W)": {"input_backward_bytes": _nothing_kept,
                                                          "split_kept_bytes": _zero},
    "optimizer per tensor (CPU)": {"optimizer_step_bytes": _proportional},
    "the batch": {"batch_bytes": _zero},
    "boundary tensors counted once": {"input_held_elsewhere_bytes": _zero, "output_saved_bytes": _zero},
    "gradients from the first backward": {"gradients_made_in_step": lambda candidate: False},
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
            rows.append([name, f"without all {len(TERMS)}", *summary(errors(subset))])
        if before is not None:
            errs = [e for x in subset for e in before[x["recipe"]]]
            rows.append([name, "the model before (--before)", *summary(errs)])
    _results.write("memory_terms", title="Peak memory: what each term of the model moves", device="cpu",
                   tables={"peak-memory error per variant (predicted vs measured, most loaded rank)":
                           _results.markdown_table(header, rows)},
                   data={"rows": rows, "source": data.get("command")}, notes=NOTES)


if __name__ == "__main__":
    main()
