"""Tuning quality and cost: `autotune search` against an exhaustive grid over the same space, side by side.

1. Grid: every synchronous schedule (the search's default space; not 2BW) x every B/M dividing B x every split,
   each run once as a real trial (2 ranks).
2. Search: autotune.tune over the same space (pp = gpus, dp = 1, no checkpointing, float32 between stages), the
   --trials budget, profile and plan included in its wall time (no config or report written); --searches times
   with seeds 0, 1, ... (a search is one draw: trials are noisy), the summary taking medians over them.
3. Side by side: each search's config, the grid's best, the rule-of-thumb default (uniform split, 1F1B,
   B/M = 4 x stages) and the uniform split at each search's schedule and B/M, run in turn --rounds times; medians.
   Trials run torch.distributed.pipelining's schedules directly (autotune.trial), one process per rank.

    python bench/tuning.py --model bench/models/skewed6.py --batch-size 64 --trials 12 --rounds 5 --searches 3
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from autotune.candidate import Candidate, Measurement, uniform_split  # noqa: E402
from autotune.errors import InvalidCandidateError  # noqa: E402
from autotune.link_fit import fit_link, measured_steps  # noqa: E402
from autotune.model_file import check_model, load_model_file  # noqa: E402
from autotune.schedules import SYNCHRONOUS_SCHEDULES, default_stages_per_rank  # noqa: E402
from autotune.search import rule_of_thumb  # noqa: E402
from autotune.simulate import LinkModel, Predictor  # noqa: E402
from autotune.trial import TrialOptions, run_trial  # noqa: E402
from autotune.tune import TuneRequest, tune  # noqa: E402


def splits(n_layers: int, n_stages: int):
    for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
        bounds = (0, *cuts, n_layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def fit_text(fit: dict | None) -> str:
    if fit is None:
        return "not fitted (under 5 measured)"
    return (f"x{1 + fit['compute_slowdown']:.2f} (x{1 + fit['given_slowdown']:.2f} given; "
            f"{fit['error_before']:.0%} -> {fit['error_after']:.0%}, {fit['trials']} runs)")


def grid(n_layers: int, gpus: int, batch_size: int) -> list[Candidate]:
    out = []
    for schedule in SYNCHRONOUS_SCHEDULES:  # the search's own space: asynchronous 2BW only with --allow-async
        n_stages = gpus * default_stages_per_rank(schedule)
        if n_stages > n_layers:
            continue
        for m in (k for k in range(1, batch_size + 1) if batch_size % k == 0):
            for split in splits(n_layers, n_stages):
                c = Candidate(
                    schedule=schedule,
                    pipeline_degree=gpus,
                    global_batch_size=batch_size,
                    n_microbatches=m,
                    layers_per_stage=split,
                )
                try:
                    c.validate(n_layers)
                except InvalidCandidateError:
                    continue
                out.append(c)
    return out


def side_by_side(
    spec, candidates: dict[str, Candidate], rounds: int, options: TrialOptions
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Median step time of each, measured in turn (A B C A B C ...) so drift hits all alike, and every round's
    times by candidate key. Names of one candidate (a search that chose the grid's best) share its runs: the same
    config is not compared with itself."""
    distinct = {c.key: c for c in candidates.values()}
    by_round: list[dict[str, float]] = []
    for _ in range(rounds):
        this: dict[str, float] = {}
        for key, candidate in distinct.items():
            m = run_trial(spec, candidate, options)
            if m.status == "ok" and m.step_time_ms:
                this[key] = m.step_time_ms
        by_round.append(this)
    times = {key: [r[key] for r in by_round if key in r] for key in distinct}
    return {name: statistics.median(times[c.key]) for name, c in candidates.items() if times[c.key]}, by_round


def quality_interval(
    by_round: list[dict[str, float]], best: str, chosen: str, draws: int = 2000
) -> tuple[float, float]:
    """90 % interval of median(best) / median(chosen), the rounds resampled with replacement (a round's runs are
    taken together, so they are drawn together): how far the side-by-side rounds can tell the two apart."""
    rng = random.Random(0)
    rounds = [r for r in by_round if best in r and chosen in r]
    if best == chosen or not rounds:
        return (1.0, 1.0)
    ratios = []
    for _ in range(draws):
        sample = [rng.choice(rounds) for _ in rounds]
        ratios.append(statistics.median(r[best] for r in sample) / statistics.median(r[chosen] for r in sample))
    ratios.sort()
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]


def compute_per_rank_ms(profile, candidate: Candidate) -> float:
    """Sum of every layer's forward + backward time over all micro-batches, divided by the pipeline ranks."""
    costs = profile.layer_costs(candidate.micro_batch_size)
    return sum(c.forward_ms + c.backward_ms for c in costs) * candidate.n_microbatches / candidate.pipeline_degree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench/models/skewed6.py")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--searches", type=int, default=3, help="independent searches (seeds 0..N-1); medians")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--name", default="tuning", help="results file name under bench/results/")
    args = parser.parse_args()

    spec = load_model_file(args.model)
    check_model(spec, args.batch_size)
    options = TrialOptions(steps=5, warmup=2, device=args.device)
    run_trial(spec, rule_of_thumb(spec.n_layers, args.gpus, args.batch_size), options)  # warm the fork server

    # 2. the searches first, each on a fresh study (its wall time includes profiling and planning). One search is
    # one draw: trials are noisy, so the same seed can end elsewhere; the summary takes the median over seeds.
    searches = []
    for seed in range(args.searches):
        started = time.time()
        outcome = tune(
            TuneRequest(
                model=Path(args.model),
                gpus=args.gpus,
                batch_size=args.batch_size,
                device=args.device,
                trials=args.trials,
                seed=seed,
                steps=options.steps,
                warmup=options.warmup,
                storage=f"sqlite:///{tempfile.mkdtemp()}/bench.db",
                study_name="bench",
                output=None,  # the searches' choices are compared below, not written
                report_dir=None,
                layouts=((args.gpus, 1),),
                checkpointing=(False,),
                wire_dtypes=("float32",),
            )
        )
        result = outcome.result
        assert result.best is not None
        # the compute slowdown the search ended with (autotune.link_fit, refitted after every run)
        fit = fit_link(Predictor(profile=outcome.profile, link=LinkModel.for_device(args.device)),
                       measured_steps(result.records))
        searches.append({"seed": seed, "wall": time.time() - started, "tuned": result.best.candidate,
                         "launched": result.launched, "records": len(result.records), "profile": outcome.profile,
                         "fit": fit.to_dict() if fit else None})

    # 1. the exhaustive grid
    candidates = grid(spec.n_layers, args.gpus, args.batch_size)
    started = time.time()
    measured: list[Measurement] = [run_trial(spec, c, options) for c in candidates]
    grid_wall = time.time() - started
    ok = [m for m in measured if m.status == "ok"]
    grid_best = min(ok, key=lambda m: m.step_time_ms or float("inf")).candidate

    # 3. side by side: every distinct choice, the grid's best, the default, and each choice's split made uniform
    default = rule_of_thumb(spec.n_layers, args.gpus, args.batch_size)
    contenders: dict[str, Candidate] = {"grid best": grid_best, "rule-of-thumb default": default}
    for s in searches:
        tuned = s["tuned"]
        contenders.setdefault(tuned.key, tuned)
        uniform = replace(tuned, layers_per_stage=uniform_split(spec.n_layers, tuned.n_stages))
        contenders.setdefault(uniform.key, uniform)
    medians, by_round = side_by_side(spec, contenders, args.rounds, options)

    for s in searches:
        tuned = s["tuned"]
        uniform_key = replace(tuned, layers_per_stage=uniform_split(spec.n_layers, tuned.n_stages)).key
        s["quality"] = medians["grid best"] / medians[tuned.key]
        s["quality_interval"] = quality_interval(by_round, grid_best.key, tuned.key)
        s["cost"] = s["wall"] / grid_wall
        s["gain"] = medians["rule-of-thumb default"] / medians[tuned.key]
        s["balance_gain"] = medians[uniform_key] / medians[tuned.key]
        s["efficiency"] = compute_per_rank_ms(s["profile"], tuned) / medians[tuned.key]
        s["rank_in_grid"] = (
            sorted(m.step_time_ms for m in ok).index(next(m.step_time_ms for m in ok if m.candidate == tuned)) + 1
            if any(m.candidate == tuned for m in ok)
            else None
        )

    def median(field: str) -> float:
        return statistics.median(s[field] for s in searches)

    quality, cost, gain = median("quality"), median("cost"), median("gain")
    balance_gain, efficiency = median("balance_gain"), median("efficiency")
    n = len(searches)
    summary = [
        [
            f"tuning quality (grid best time / search time, side by side; median of {n} searches)",
            quality,
            ">= 0.95 (issue 4), goal 0.99",
            "met" if quality >= 0.99 else ("met 0.95" if quality >= 0.95 else "missed"),
        ],
        [
            "tuning cost (search wall / grid wall)",
            cost,
            "<= 0.30 (issue 4), goal 0.15",
            "met" if cost <= 0.15 else ("met 0.30" if cost <= 0.3 else "missed"),
        ],
        ["gain over the rule-of-thumb default", gain, ">= 1.25", "met" if gain >= 1.25 else "missed"],
        [
            "gain of the chosen split over uniform (same schedule, B/M)",
            balance_gain,
            "> 1",
            "met" if balance_gain > 1 else "missed",
        ],
        [
            "pipeline efficiency (compute per rank / step)",
            efficiency,
            ">= 0.9",
            "met" if efficiency >= 0.9 else "missed",
        ],
    ]
    per_search = [
        [s["seed"], s["tuned"].key, s["quality"], "{:.3f}-{:.3f}".format(*s["quality_interval"]), s["cost"],
         s["gain"], s["balance_gain"], s["rank_in_grid"],
         s["launched"], s["records"], s["wall"], fit_text(s["fit"])]
        for s in searches
    ]
    contenders_rows = [
        [name, c.key, medians.get(name),
         args.batch_size / medians[name] * 1000 if name in medians else None]
        for name, c in contenders.items()
    ]
    _results.write(
        args.name,
        title="Tuning quality and cost",
        device=args.device,
        tables={
            "summary": _results.markdown_table(["measure", "value", "target", "status"], summary),
            "each search": _results.markdown_table(
                ["seed", "choice", "quality", "quality's 90 % interval (rounds resampled)", "cost", "gain",
                 "split gain", "rank in grid's single runs",
                 "launched", "records (incl. pruned)", "wall s (incl. profile, plan)",
                 "compute fitted at the end (mean error of its runs' predictions)"],
                per_search,
            ),
            f"side by side ({args.rounds} rounds, medians)": _results.markdown_table(
                ["config", "candidate", "step ms", "samples/s"], contenders_rows
            ),
            "runs": _results.markdown_table(
                ["", "value"],
                [
                    ["model", args.model],
                    ["gpus / batch", f"{args.gpus} / {args.batch_size}"],
                    ["grid size (trials)", len(candidates)],
                    ["grid ok", len(ok)],
                    ["grid wall s", grid_wall],
                    ["search trial budget", args.trials],
                    ["searches (seeds)", n],
                ],
            ),
        },
        data={
            "quality": quality,
            "cost": cost,
            "gain": gain,
            "balance_gain": balance_gain,
            "efficiency": efficiency,
            "grid_wall_s": grid_wall,
            "searches": [{k: (v.key if isinstance(v, Candidate) else v) for k, v in s.items() if k != "profile"}
                         for s in searches],
            "medians_ms": medians,
            "side_by_side_rounds_ms": by_round,
            "contenders": {k: c.key for k, c in contenders.items()},
            "grid": [
                {"candidate": m.candidate.key, "status": m.status, "step_time_ms": m.step_time_ms} for m in measured
            ],
        },
    )


if __name__ == "__main__":
    main()
