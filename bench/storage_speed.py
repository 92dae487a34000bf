"""A search's storage time: `run_search` on a local SQLite study with a trial runner that measures by simulation (no
process, no model), so what is left of its wall time is the sampler, the simulator and the storage. The storage's
share: the search thread's time inside the methods of the storage object its Optuna study holds (whatever
`optuna.storages.get_storage` makes of autotune's storage: Optuna's cache layer around an RDBStorage, or a storage
object passed as it is), outermost calls only, in wall and in CPU time (the CPU time is less swayed by other work
on a shared machine; the wall time also holds SQLite's waits on the disk). Median of --repeats searches; with
--code, each search runs in a process of its own on the autotune found at that path (to compare commits:
`git archive <commit> | tar -x -C DIR`), the codes taking turns so that a change in the machine's load falls on all.

    python bench/storage_speed.py --trials 150 --repeats 3 --code before=/tmp/base --code after=.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CODE_ENV = "AUTOTUNE_BENCH_CODE"
"""Set in the process that runs one search: the checkout whose autotune (and tests.fakes) it imports."""
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, os.environ.get(CODE_ENV, str(ROOT)))
import _results  # noqa: E402
import optuna  # noqa: E402

from autotune.costs import LayerCost, Profile  # noqa: E402
from autotune.model_file import load_model_file  # noqa: E402
from autotune.plan import plan  # noqa: E402
from autotune.search import SearchOptions, run_search  # noqa: E402
from tests.fakes import SimulatedRunner  # noqa: E402


class StorageClock:
    """Wall time the main thread spends inside the storage object's methods (outermost calls), per search."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        """The same calls' CPU time (the search thread's): less swayed by other work on the machine."""
        self.calls = 0
        self._depth = 0
        self._timed: set[type] = set()

    def install(self) -> None:
        make = optuna.storages.get_storage

        def get_storage(storage: Any) -> Any:
            made = make(storage)
            self.time_class(type(made))
            return made

        optuna.storages.get_storage = get_storage

    def time_class(self, cls: type) -> None:
        if cls in self._timed:
            return
        self._timed.add(cls)
        for name, value in list(vars(cls).items()):
            if callable(value) and not name.startswith("__") and not isinstance(value, (staticmethod, classmethod)):
                setattr(cls, name, self.timed(value))

    def timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                return method(*args, **kwargs)
            self._depth += 1
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - started
                    self.cpu_seconds += time.thread_time() - cpu
                    self.calls += 1

        return call


CLOCK = StorageClock()


def profile() -> Profile:
    """24 layers of uneven cost: a search space with hundreds of distinct candidates over 8 GPUs."""
    costs = [1.0, 6.0, 6.0, 1.0, 1.0, 0.5, 0.5, 0.5, 2.0, 3.0, 1.5, 0.5] * 2
    layers = [LayerCost(forward_ms=c, backward_input_ms=c, backward_weight_ms=c, saved_bytes=1000, output_bytes=100,
                        parameter_bytes=400) for c in costs]
    return Profile.from_layer_costs(layers, micro_batch_size=4, input_bytes=100)


def one_search(n_trials: int, folder: Path) -> dict[str, float]:
    p = profile()
    options = SearchOptions(gpus=8, batch_size=64, n_trials=n_trials, seed=1, prune_margin=10.0)
    planned = plan(p, gpus=8, batch_size=64, memory_limit_bytes=None)
    spec = load_model_file(ROOT / "recipes" / "gpt.py")  # any spec: the simulated runner never uses it
    url = f"sqlite:///{folder / 'study.db'}"
    CLOCK.seconds, CLOCK.cpu_seconds, CLOCK.calls = 0.0, 0.0, 0
    started, cpu = time.perf_counter(), time.process_time()
    result = run_search(spec, p, planned, options, study_name="bench", storage=url, runner=SimulatedRunner(p))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "storage_s": CLOCK.seconds, "storage_cpu_s": CLOCK.cpu_seconds,
            "storage_calls": float(CLOCK.calls),
            "trials": float(len(result.records)), "launched": float(result.launched)}


def run_elsewhere(code: Path, n_trials: int) -> dict[str, float]:
    """One search in a fresh process importing the autotune at `code`."""
    out = subprocess.run([sys.executable, __file__, "--one", "--trials", str(n_trials)], check=True,
                         capture_output=True, text=True, env={**os.environ, CODE_ENV: str(code.resolve())})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=150, help="the search's budget of launched trials")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--code", action="append", default=[], metavar="LABEL=PATH",
                        help="a checkout to measure (repeatable); default: this one, in this process")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one search, its numbers as JSON
    parser.add_argument("--no-write", action="store_true", help="print only; do not write bench/results")
    parser.add_argument("--note", default="", help="what the codes are, written under the table")
    args = parser.parse_args()
    if args.one or not args.code:
        CLOCK.install()
    if args.one:
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(one_search(args.trials, Path(folder))))
        return
    codes = dict(code.split("=", 1) for code in args.code)
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in codes or {"this code": ""}}
    for _ in range(args.repeats):
        for label in runs:
            if codes:
                runs[label].append(run_elsewhere(Path(codes[label]), args.trials))
            else:
                with tempfile.TemporaryDirectory() as folder:
                    runs[label].append(one_search(args.trials, Path(folder)))
            load = os.getloadavg()[0]
            runs[label][-1]["load_1min"] = load
            print(f"{label}: {runs[label][-1]}", flush=True)
    rows = {}
    for label, measured in runs.items():
        row = {key: statistics.median(r[key] for r in measured) for key in measured[0]}
        row["per_call_ms"] = row["storage_s"] / max(row["storage_calls"], 1) * 1000
        rows[label] = row
        print(f"{label} (median of {args.repeats}): {row}")
    if args.no_write:
        return
    table = _results.markdown_table(
        ["code", "trials", "launched", "search wall s", "search CPU s", "storage s", "storage CPU s", "storage calls",
         "ms per call", "load (1 min)"],
        [[label, row["trials"], row["launched"], row["wall_s"], row["cpu_s"], row["storage_s"], row["storage_cpu_s"],
          row["storage_calls"], row["per_call_ms"], row["load_1min"]] for label, row in rows.items()],
    )
    _results.write("storage_speed", title="A search's storage time (SQLite, simulated trials)", device="cpu",
                   tables={"search": table}, data={"rows": rows, "repeats": args.repeats, "codes": codes},
                   notes=args.note)


if __name__ == "__main__":
    main()
