"""Two torchrun "nodes" on this machine (`--nnodes 2 --nproc-per-node 1`, one CPU rank each): node 0 runs the study
and writes the config, node 1 runs its ranks of every trial; a rank failing or hanging on node 1 is named
`node 1 rank 1`; killing node 1's autotune process ends node 0 with one line, a resumable study and no orphans."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from autotune.shared_study import load_records
from tests.conftest import RECIPES

pytestmark = pytest.mark.dist
TORCHRUN = Path(sys.executable).with_name("torchrun")

FAULTY = """
import os, pathlib, time
exec(compile(pathlib.Path({recipe!r}).read_text(), {recipe!r}, "exec"))
_build_model = build_model

def build_model():
    # On global rank 1 only: the first trial's rank raises, the second's hangs, the others run.
    if os.environ.get("RANK") == "1":
        marks = pathlib.Path({marks!r})
        mine = marks / str(os.getpid())
        if not mine.exists():
            mine.write_text(str(len(list(marks.iterdir()))))
        turn = int(mine.read_text())
        if turn == 0 and {faults}:
            raise ValueError("boom from global rank 1")
        if turn == 1 and {faults}:
            time.sleep(600)
        if not {faults}:  # held inside a trial on node 1 until the test has looked (it writes "release")
            deadline = time.time() + 120
            while not (marks.parent / "release").exists() and time.time() < deadline:
                time.sleep(0.05)
    return _build_model()
"""


def model(tmp_path: Path, *, faults: bool) -> Path:
    marks = tmp_path / "marks"
    marks.mkdir()
    path = tmp_path / "model.py"
    path.write_text(FAULTY.format(recipe=str(RECIPES / "mlp.py"), marks=str(marks), faults=faults))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_nodes(model_file: Path, folder: Path, *args: str, per_node: int = 1) -> list[subprocess.Popen[str]]:
    port = free_port()
    search = ["search", str(model_file), "--gpus", str(2 * per_node), "--gpus-per-node", str(per_node), "--device",
              "cpu", "--batch-size", "64",
              "--steps", "2", "--warmup", "1", "--storage", f"sqlite:///{folder / 'study.db'}", "--study-name", "s",
              "--output", str(folder / "autotune.yaml"), "--report-dir", str(folder / "report"), *args]
    return [
        subprocess.Popen([str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                          "--master-addr", "127.0.0.1", "--master-port", str(port), "--monitor-interval", "0.5",
                          "-m", "autotune", *search],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder)
        for node in (0, 1)
    ]


def records(folder: Path) -> list:
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{folder / 'study.db'}")
    return load_records(study)[0]


def test_a_search_over_two_nodes_names_the_node_of_a_failing_or_hung_rank(tmp_path: Path) -> None:
    nodes = two_nodes(model(tmp_path, faults=True), tmp_path, "--trials", "5", "--trial-timeout", "10")
    outputs = [p.communicate(timeout=300) for p in nodes]
    for p, (_, err) in zip(nodes, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    probe_line = next(line for line in outputs[0][1].splitlines() if "inter-node link" in line)
    assert "inter-node link (node 0 <-> node 1, probed): " in probe_line  # measured before the plan
    assert "(all-reduce " in probe_line  # and what the backend's all-reduce gets of it
    config = yaml.safe_load((tmp_path / "autotune.yaml").read_text())
    assert (config["nodes"], config["gpus_per_node"], config["gpus"]) == (2, 1, 2)
    launched = [r for r in records(tmp_path) if r.launched]
    # the two faulty trials and at least one that ran; how many more depends on the profile (on a loaded machine
    # every other proposal can be predicted too slow and pruned, which ends the search early)
    assert 3 <= len(launched) <= 5
    raised, hung, *ok = launched
    assert raised.outcome == "error" and raised.reason.startswith("node 1 rank 1: ValueError: boom from global rank 1")
    assert hung.outcome == "timeout" and ("node 1 rank 1 hung outside torch.distributed" in hung.reason
                                          or "node 1 rank 1 hung: by every rank's progress" in hung.reason)
    assert "waiting ranks: node 0 rank 0" in hung.reason
    assert hung.wall_time_s < 10 + 30
    assert ok and all(r.outcome == "ok" for r in ok)
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    nodes_seen = {tuple(t.user_attrs["measurement"].get("rank_nodes", ())) for t in study.trials
                  if "measurement" in t.user_attrs}
    assert nodes_seen == {(0, 1)}  # every run had its rank 0 on node 0 and its rank 1 on node 1


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def started(pid: int) -> int:
    """The process's start time, in clock ticks since boot (/proc/PID/stat's 22nd field)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 2**63


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_killing_node_1_ends_node_0_with_one_line_a_resumable_study_and_no_orphans(tmp_path: Path) -> None:
    model_file = model(tmp_path, faults=False)
    nodes = two_nodes(model_file, tmp_path, "--trials", "4")
    deadline = time.time() + 120
    while not list((tmp_path / "marks").iterdir()):  # a trial runs a rank on node 1
        assert time.time() < deadline and nodes[0].poll() is None, nodes[0].communicate()[1][-3000:]
        time.sleep(0.2)
    tree = descendants(nodes[0].pid) | descendants(nodes[1].pid)
    # node 1's autotune process: the torchrun agent's child, the oldest of its descendants (by start time, not pid:
    # pids wrap around in a long suite)
    agent = min(descendants(nodes[1].pid), key=started)
    os.kill(agent, signal.SIGKILL)
    killed_at = time.time()
    (tmp_path / "release").write_text("")  # node 1's ranks may go on now (and those of the resumed search)
    outputs = [p.communicate(timeout=120) for p in nodes]
    assert nodes[0].returncode != 0 and time.time() - killed_at < 30
    assert "node 1 stopped answering" in outputs[0][1] and "--resume continues it" in outputs[0][1]
    err = outputs[0][1]  # autotune's one line, then torchrun's own report of a failed worker (its traceback)
    assert err.index("node 1 stopped answering") < err.find("Traceback") and "autotune/" not in err.split(
        "Traceback", 1)[1]
    deadline = time.time() + 30  # the killed tree's processes are reaped by now or shortly
    while [pid for pid in tree if alive(pid)] and time.time() < deadline:
        time.sleep(0.1)
    assert [pid for pid in tree if alive(pid)] == []
    lost = [r for r in records(tmp_path) if r.launched and r.outcome == "error"]
    assert lost and "node 1 stopped answering" in lost[-1].reason

    before = len([r for r in records(tmp_path) if r.launched])
    again = two_nodes(model_file, tmp_path, "--trials", "2", "--resume")
    for p, (_, err) in zip(again, [p.communicate(timeout=300) for p in again], strict=True):
        assert p.returncode == 0, err[-3000:]
    assert len([r for r in records(tmp_path) if r.launched]) > before  # the study went on


def test_a_search_over_two_nodes_of_two_ranks_measures_both_rank_orders(tmp_path: Path) -> None:
    # pp 2 x dp 2 over two nodes of 2: pp-inner keeps each pipeline in a node, dp-inner each stage's replicas. The
    # planner's best such candidate is run in both orders right after the default (4 ranks: the smallest case).
    nodes = two_nodes(RECIPES / "mlp.py", tmp_path, "--trials", "4", per_node=2)
    outputs = [p.communicate(timeout=300) for p in nodes]
    for p, (_, err) in zip(nodes, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    pair = [r for r in records(tmp_path) if r.phase == "rank-order"]
    assert [r.outcome for r in pair] == ["ok", "ok"], [r.reason for r in pair]
    assert {r.candidate.rank_order for r in pair} == {"pp-inner", "dp-inner"}
    assert {(r.candidate.pipeline_degree, r.candidate.data_parallel_degree) for r in pair} == {(2, 2)}
