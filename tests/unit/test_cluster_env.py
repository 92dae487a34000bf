"""Which node this process is, from torchrun's or Slurm's environment."""

from __future__ import annotations

import pytest

from autotune.cluster.env import detect, expand_nodelist
from autotune.errors import ClusterError

TORCHRUN = {"TORCHELASTIC_RUN_ID": "r1", "GROUP_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True"}
SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
         "SLURM_JOB_ID": "4242"}


@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("n[001-002],m[1]", ["n001", "n002", "m1"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


def test_torchrun_node_uses_the_agents_store():
    env = detect(TORCHRUN)
    assert (env.node, env.n_nodes, env.master_addr, env.master_port) == (1, 2, "10.0.0.1", 29400)
    assert env.launcher == "torchrun" and not env.host_store and env.run_id == "r1"


def test_slurm_node_0_hosts_the_store_on_the_first_host():
    env = detect(SLURM)
    assert (env.node, env.n_nodes, env.master_addr, env.master_port) == (0, 2, "gpu07", 20000 + 4242)
    assert env.launcher == "slurm" and env.host_store
    assert not detect({**SLURM, "SLURM_PROCID": "1"}).host_store


def test_one_task_or_no_launcher_is_one_machine():
    assert detect({}).n_nodes == 1
    assert detect({**SLURM, "SLURM_NTASKS": "1", "SLURM_NNODES": "1"}).launcher == "local"


@pytest.mark.parametrize("environ, flag", [({**TORCHRUN, "LOCAL_WORLD_SIZE": "2"}, "--nproc-per-node 1"),
                                           ({**SLURM, "SLURM_NTASKS": "4"}, "--ntasks-per-node 1")])
def test_more_than_one_process_per_node_is_refused(environ, flag):
    with pytest.raises(ClusterError, match=flag):
        detect(environ)


@pytest.mark.parametrize("args, message", [
    (["--gpus", "2"], "pass --gpus-per-node"),
    (["--gpus", "3", "--gpus-per-node", "1"], "--gpus 3 is not 2 nodes x 1 ranks per node; pass --gpus 2"),
])
def test_search_over_nodes_checks_its_ranks_before_joining(monkeypatch, tmp_path, args, message):
    from typer.testing import CliRunner

    from autotune.cli import app

    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    model = tmp_path / "model.py"
    model.write_text("")
    result = CliRunner().invoke(app, ["search", str(model), "--batch-size", "8", "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
