"""2BW against 1F1B at the same batch, micro-batch count and split: measured step time, the simulator's prediction
of both, and the loss after the trial's updates.

Per model (--models, recipes/<name>.py): one profile with the product's profiler (load_and_profile, at the
micro-batch sizes asked), one split (the time-balanced split the planner starts from, at the middle micro-batch
size), then for each --microbatches M a real `autotune trial` of 1F1B and of 2BW (run_trial, the call the command
makes; pp 2 on 2 CPU ranks), interleaved 1F1B, 2BW, 1F1B, 2BW ... --repeats times so that drifting machine load hits
both, and the median of each.

A 2BW trial times its --steps steps as one window (the pipeline fills and drains once), so where 1F1B's bubble is
large (few micro-batches per stage) 2BW's step should be shorter by about that bubble. The simulator predicts 2BW's
steady state (two steps' replay less one); a k-step window also pays 1/k of the fill and drain, so the table gives
the prediction for the trial's window too. Both schedules run the same number of optimizer updates before the loss
is read (1F1B gets more warm-up steps: a 2BW trial's unmeasured window is as long as its measured one); 2BW's loss
still differs because each update uses the gradient of weights one step older.

    python bench/two_bw.py                     # mlp, gpt, hf_llama (cnn without transformers); M 2 4 8; 5 repeats
    python bench/two_bw.py --models mlp --microbatches 2 --repeats 1 --steps 2 --no-write   # smoke

Not a test: on a loaded machine the step times are noise. Run it on a quiet one and read bench/results/two_bw.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PIPELINE_DEGREE = 2
WARMUP = 2
"""The 2BW trial's warm-up steps (the trial's default); 1F1B's are set so that both make as many updates."""


def default_models() -> list[str]:
    third = "hf_llama" if importlib.util.find_spec("transformers") else "cnn"  # neither ties parameters (2BW refuses)
    return ["mlp", "gpt", third]


def updates_before_loss(schedule: str, warmup: int, steps: int) -> int:
    """Optimizer updates a trial makes before the step whose loss it reports, its last measured one (trial.worker):
    the warm-up steps, one untracked step (2BW: a window as long as the measured one), the other measured steps."""
    return warmup + (steps if schedule == "2BW" else 1) + steps - 1


def cell(value: float | None) -> float | str:
    return "-" if value is None else value


def ratio(measured: float | None, predicted: float) -> float | str:
    return measured / predicted if measured is not None and predicted > 0 else "-"


def median(values: list[float | None]) -> float | None:
    """The median of the values there are (a failed trial has none); None without any."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def predictions(profile: Any, candidate: Any, steps: int) -> dict[str, float]:
    """The simulator's step for the candidate as a search predicts it (Predictor, the device's default link), its
    1F1B bubble, and for 2BW its step over a trial's window of `steps` steps: the steady state with the steady
    pipeline replaced by 1/steps of one 1F1B over all the window's micro-batches (2BW's action list is 1F1B's)."""
    from dataclasses import replace

    from autotune.schedules import Schedule
    from autotune.simulate import LinkModel, Predictor

    predict = Predictor(profile=profile, link=LinkModel.for_device(profile.device))
    est = predict(candidate)
    out = {"step_ms": est.step_time_ms, "pipeline_ms": est.pipeline_time_ms, "bubble": est.bubble_fraction}
    if candidate.schedule is Schedule.TWO_BW:
        m, b = candidate.n_microbatches, candidate.global_batch_size
        window = predict(replace(candidate, schedule=Schedule.ONE_F_ONE_B, n_microbatches=steps * m,
                                 global_batch_size=steps * b))
        out["window_step_ms"] = est.step_time_ms - est.pipeline_time_ms + window.pipeline_time_ms / steps
    return out


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from autotune.candidate import Candidate
    from autotune.partition import balanced_split
    from autotune.schedules import TIED_ASYNC, Schedule
    from autotune.trial import TrialOptions, run_trial
    from autotune.tune import load_and_profile

    model = ROOT / "recipes" / f"{name}.py"
    sizes = sorted({args.batch_size // m for m in args.microbatches})
    print(f"{name}: profiling at micro-batch sizes {sizes}", file=sys.stderr)
    spec, profile = load_and_profile(model, args.batch_size, "cpu", micro_batch_sizes=sizes)
    if spec.shared:
        sys.exit(f"{model}: {TIED_ASYNC}; pick another model")
    middle = sizes[len(sizes) // 2]
    split = balanced_split(profile.layer_costs(middle), Schedule.ONE_F_ONE_B, PIPELINE_DEGREE, PIPELINE_DEGREE)
    warmup = {"1F1B": WARMUP + args.steps - 1, "2BW": WARMUP}
    runs: dict[tuple[int, str], list[Any]] = {(m, s): [] for m in args.microbatches for s in warmup}
    for r in range(args.repeats):
        for m in args.microbatches:
            for schedule in warmup:  # 1F1B, then 2BW: the pair at one machine load
                candidate = Candidate(schedule=Schedule(schedule), pipeline_degree=PIPELINE_DEGREE,
                                      global_batch_size=args.batch_size, n_microbatches=m, layers_per_stage=split)
                measured = run_trial(spec, candidate, TrialOptions(steps=args.steps, warmup=warmup[schedule],
                                                                    device="cpu"))
                print(f"{name} repeat {r + 1}/{args.repeats} {candidate.key}: {measured.status} "
                      f"{measured.step_time_ms} ms, loss {measured.loss}", file=sys.stderr)
                runs[m, schedule].append(measured)

    rows, data_rows = [], []
    for m in args.microbatches:
        ok = {s: [x for x in runs[m, s] if x.status == "ok"] for s in warmup}
        step = {s: median([x.step_time_ms for x in ok[s]]) for s in warmup}
        loss = {s: median([x.loss for x in ok[s]]) for s in warmup}
        sim = {s: predictions(profile, runs[m, s][0].candidate, args.steps) for s in warmup}
        saved = step["1F1B"] - step["2BW"] if step["1F1B"] is not None and step["2BW"] is not None else None
        loss_diff = loss["2BW"] - loss["1F1B"] if loss["1F1B"] is not None and loss["2BW"] is not None else None
        sim_saved = sim["1F1B"]["step_ms"] - sim["2BW"]["step_ms"]
        sim_window_saved = sim["1F1B"]["step_ms"] - sim["2BW"]["window_step_ms"]
        failed = [f"{s} {x.status}" for s in warmup for x in runs[m, s] if x.status != "ok"]
        row = {
            "model": name, "n_microbatches": m, "micro_batch_size": args.batch_size // m,
            "step_ms": step, "saved_ms": saved, "loss": loss, "loss_diff": loss_diff,
            "predicted": sim, "predicted_saved_ms": sim_saved, "predicted_window_saved_ms": sim_window_saved,
            "updates_before_loss": {s: updates_before_loss(s, warmup[s], args.steps) for s in warmup},
            "failed": failed,
        }
        data_rows.append(row)
        rows.append([name, m, args.batch_size // m, f"{sim['1F1B']['bubble']:.0%}", cell(step["1F1B"]),
                     cell(step["2BW"]), cell(saved), sim["1F1B"]["step_ms"], sim["2BW"]["step_ms"], sim_saved,
                     ratio(saved, sim_saved), sim["2BW"]["window_step_ms"], ratio(saved, sim_window_saved),
                     cell(loss["1F1B"]), cell(loss["2BW"]), cell(loss_diff), ", ".join(failed) or "-"])
    return {"model": name, "layers_per_stage": list(split), "profile_micro_batch_sizes": sizes, "rows": rows,
            "data": data_rows, "trials": {f"{s}/m{m}": [x.to_dict() for x in v] for (m, s), v in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=default_models(), help="recipes/<name>.py, untied")
    parser.add_argument("--microbatches", nargs="+", type=int, default=[2, 4, 8], help="M per step, each >= 2")
    parser.add_argument("--repeats", type=int, default=5, help="1F1B/2BW pairs per model and M")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per trial (2BW: its window)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/results alone")
    args = parser.parse_args()
    bad = [m for m in args.microbatches if m < PIPELINE_DEGREE or args.batch_size % m]
    if bad:
        parser.error(f"--microbatches {bad}: each must be at least {PIPELINE_DEGREE} (2BW's stages) and divide "
                     f"--batch-size {args.batch_size}")

    from autotune.trial import server

    server.start()  # the ranks fork from it; its torch import overlaps the profiling
    load_before = os.getloadavg()
    started = time.perf_counter()
    results = [bench_model(name, args) for name in args.models]
    run = {"load_before": load_before, "load_after": os.getloadavg(), "wall_s": time.perf_counter() - started,
           "steps": args.steps, "repeats": args.repeats, "batch_size": args.batch_size}

    header = ["model", "M", "micro-batch size", "1F1B bubble (sim)", "1F1B ms", "2BW ms", "saved ms",
              "sim 1F1B ms", "sim 2BW ms (steady)", "sim saved ms", "saved / sim saved",
              f"sim 2BW ms ({args.steps}-step window)", "saved / sim window saved", "loss 1F1B", "loss 2BW",
              "loss 2BW - 1F1B", "failed trials"]
    table = _results.markdown_table(header, [row for r in results for row in r["rows"]])
    splits = ", ".join(f"{r['model']} {r['layers_per_stage']}" for r in results)
    k, warm_1f1b = args.steps, WARMUP + args.steps - 1
    notes = f"""\
Median of {args.repeats} trials each, interleaved 1F1B, 2BW per repeat; pp 2 on 2 CPU ranks (one thread each),
B = {args.batch_size}, {k} measured steps per trial (2BW: one window of {k}), fp32. Splits (time-balanced at the
middle micro-batch size, the same for both schedules and every M): {splits}.
Load average before / after: {run['load_before'][0]:.2f} / {run['load_after'][0]:.2f}; wall {run['wall_s']:.0f} s.

Saved = 1F1B's median step - 2BW's. The simulator's 2BW step is its steady state (fill and drain paid once per
run); the trial's window pays 1/{k} of them per step, hence the window column. saved / sim saved near 1: the
measured saving is the bubble the simulator predicts.

Loss: the mean micro-batch loss of the last measured step, after {updates_before_loss("2BW", WARMUP, k)} updates in both
trials (1F1B got {warm_1f1b} warm-up steps, 2BW {WARMUP}: a 2BW trial's unmeasured window is {k} steps long). The
difference is 2BW's one-step weight delay (each update uses the gradient of the weights one step older), not an
error."""
    if args.no_write:
        print(table)
        print(notes)
        return
    _results.write("two_bw", title="2BW against 1F1B: step time, predicted saving and loss", device="cpu",
                   tables={"2BW vs 1F1B at the same B, M and split": table},
                   data={"run": run, "models": [{key: v for key, v in r.items() if key != "rows"} for r in results]},
                   notes=notes)


if __name__ == "__main__":
    main()
