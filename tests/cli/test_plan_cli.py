"""`autotune profile` and `autotune plan`: exit codes, one-line errors, and the JSON they print."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from autotune.cli import app
from autotune.partition import EVEN_WITHIN

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def model(model_file):
    return model_file()  # 4 layers: Linear, Tanh, Linear, Linear


def test_plan_json_lists_ranked_candidates(model):
    result = invoke("plan", model, "--gpus", 2, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--json")
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)
    assert isinstance(planned, list) and 1 <= len(planned) <= 10
    for entry in planned:
        assert entry["pipeline_degree"] * entry["data_parallel_degree"] == 2 and entry["global_batch_size"] == 8
        assert 8 % (entry["num_microbatches"] * entry["data_parallel_degree"]) == 0
        assert sum(entry["layers_per_stage"]) == 4
        assert entry["predicted_step_time_ms"] > 0
        assert len(entry["predicted_peak_memory_bytes"]) == entry["pipeline_degree"]
        assert entry["feasible"] is True  # no limit on cpu
    # the documented order: by ranked speed, which is the candidate's own unless it is a more even split of a
    # configuration whose fastest split is within EVEN_WITHIN (then that split's, and ranked_as says so)
    ranked = [entry["ranked_throughput_samples_per_s"] for entry in planned]
    assert ranked == sorted(ranked, reverse=True)
    for entry in planned:
        own = entry["predicted_throughput_samples_per_s"]
        if entry["ranked_as"] is None:
            assert entry["ranked_throughput_samples_per_s"] == own
        else:
            assert own < entry["ranked_throughput_samples_per_s"] <= own * (1 + EVEN_WITHIN)
            assert "more even split of" in entry["ranked_as"]


def test_plan_table_shows_the_recommended_range(model):
    result = invoke("plan", model, "--gpus", 2, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--top", 3)
    assert result.exit_code == 0, result.output
    assert "recommended B/M:" in result.stdout
    assert "samples/s" in result.stdout


def test_plan_with_nothing_feasible_exits_3_and_says_what_would_fit(model):
    result = invoke("plan", model, "--gpus", 2, "--batch-size", 8, "--device", "cpu", "--repeats", 1,
                    "--memory-limit", "1KiB")
    assert result.exit_code == 3, result.output
    # the limit binds the profiler too: one block's training state does not fit, and the message says how much
    assert "block 0 (Linear) alone needs more memory" in result.stderr
    assert "at least " in result.stderr and "under the memory limit of 1.0 KiB" in result.stderr
    assert "--memory-limit" in result.stderr and "Traceback" not in result.output


def test_plan_top_and_memory_limit_keep_only_what_fits(model):
    result = invoke("plan", model, "--gpus", 2, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--json",
                    "--top", 2, "--memory-limit", "1GiB")
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)
    assert len(planned) == 2 and all(entry["feasible"] for entry in planned)


def test_plan_more_ranks_than_layers_is_a_usage_error(model):
    # 8 ranks over 4 layers need dp >= 2, which batch size 1 cannot be split into
    result = invoke("plan", model, "--gpus", 8, "--batch-size", 1, "--device", "cpu", "--repeats", 1)
    assert result.exit_code == 2, result.output
    assert "use --gpus 4 or fewer" in result.stderr


def test_plan_more_ranks_than_layers_uses_data_parallel_replicas(model):
    result = invoke("plan", model, "--gpus", 8, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--top", 50,
                    "--json")
    assert result.exit_code == 0, result.output
    layouts = {(e["pipeline_degree"], e["data_parallel_degree"]) for e in json.loads(result.stdout)}
    assert layouts and all(pp * dp == 8 and pp <= 4 for pp, dp in layouts)


def test_plan_table_shows_the_layout(model):
    result = invoke("plan", model, "--gpus", 2, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--top", 50)
    assert result.exit_code == 0, result.output
    assert "pp×dp×tp" in result.stdout and "2×1×1" in result.stdout and "1×2×1" in result.stdout


def test_auto_device_without_cuda_says_to_pass_cpu(model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in (["plan", model, "--gpus", 2], ["profile", model]):
        result = invoke(*command, "--batch-size", 8)
        assert result.exit_code == 4, result.output
        assert "--device cpu" in result.stderr


def test_profile_json_with_repeated_and_comma_sizes(model):
    result = invoke("profile", model, "--batch-size", 8, "--device", "cpu", "--repeats", 1,
                    "--micro-batch-size", "1,2", "-M", 8, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["micro_batch_sizes"] == [1, 2, 8]
    assert len(data["layers"]) == 4
    assert {"forward_ms", "backward_input_ms", "backward_weight_ms", "saved_bytes", "output_bytes"} <= set(
        data["layers"][0]
    )


def test_profile_every_block_and_a_memory_limit_that_rules_out_the_largest_size(model, tmp_path, monkeypatch):
    import autotune.profiling

    monkeypatch.setattr(autotune.profiling, "IN_PLACE_COPIES", 2)
    measured = []
    real = autotune.profiling.materialize
    monkeypatch.setattr(autotune.profiling, "materialize",
                        lambda *args, **kwargs: measured.append(list(args[3])[-1]) or real(*args, **kwargs))
    wide = tmp_path / "wide.py"
    wide.write_text(
        "import torch\nfrom torch import nn\n"
        "def build_model():\n    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(5)])\n"
        "def make_batch(b):\n    return torch.randn(b, 256), torch.randn(b, 256)\n"
        "def loss_fn(o, t):\n    return nn.functional.mse_loss(o, t)\n"
        "def build_optimizer(params):\n    return torch.optim.SGD(params, lr=0.1)\n"
    )
    result = invoke("profile", wide, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--profile-every-block",
                    "-M", "2,8", "--json")
    assert result.exit_code == 0, result.output
    assert measured == [0, 1, 2, 3, 4]  # without the flag, block 3 would take block 2's figures
    assert json.loads(result.stdout)["infeasible_micro_batch_sizes"] == []
    measured.clear()
    result = invoke("profile", wide, "--batch-size", 4096, "--device", "cpu", "--repeats", 1, "-M", "2,4096",
                    "--memory-limit", "24MiB")
    assert result.exit_code == 0, result.output
    assert measured == [0, 1, 2, 4]
    assert "out of memory for one block at micro-batch size(s) 4096" in result.stdout
    assert "micro-batch size(s) 4096 ran out of memory" in result.stderr


def test_profile_table(model):
    result = invoke("profile", model, "--batch-size", 4, "--device", "cpu", "--repeats", 1)
    assert result.exit_code == 0, result.output
    assert "per layer, micro-batch size 4" in result.stdout
    assert "optimizer step" in result.stdout


@pytest.mark.parametrize("sizes, message", [("two", "cannot read --micro-batch-size"), ("0", "at least 1")])
def test_profile_bad_sizes_are_usage_errors(model, sizes, message):
    result = invoke("profile", model, "--batch-size", 8, "--device", "cpu", "--micro-batch-size", sizes)
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_missing_model_file_is_a_usage_error(tmp_path):
    result = invoke("plan", tmp_path / "nope.py", "--gpus", 2, "--batch-size", 8, "--device", "cpu")
    assert result.exit_code == 2
    assert "no such file" in result.stderr


def test_profile_output_then_plan_from_it_over_nodes_without_the_model(model, tmp_path):
    saved = tmp_path / "profile.json"
    result = invoke("profile", model, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--output", saved)
    assert result.exit_code == 0, result.output
    assert json.loads(saved.read_text())["batch_size"] == 8
    model.unlink()  # planning from the saved profile needs no model file
    result = invoke("plan", "--profile", saved, "--nodes", 2, "--gpus-per-node", 2, "--json", "--top", 50)
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)
    assert all(e["pipeline_degree"] * e["data_parallel_degree"] == 4 and e["global_batch_size"] == 8
               for e in planned)
    assert {"dp-inner"} <= {e.get("rank_order") for e in planned if e["pipeline_degree"] == 2}
    table = invoke("plan", "--profile", saved, "--nodes", 2, "--gpus-per-node", 2, "--inter-node-bandwidth", 0.5)
    assert table.exit_code == 0, table.output
    assert "2 nodes of 2; inter-node link assumed 0.5 GB/s" in " ".join(table.stdout.split())
    # replicate and shard side by side, in the profile's precision (fp32 on cpu); another precision is refused
    # (no memory limit on cpu: keeping the stages gathered fits, so resharding after forward is not planned)
    every = json.loads(invoke("plan", "--profile", saved, "--gpus", 4, "--json", "--top", 1000).stdout)
    assert {(e["data_parallel_mode"], e["fsdp_reshard_after_forward"]) for e in every
            if e["data_parallel_degree"] > 1} == {("replicate", False), ("shard", False)}
    assert {e["precision"] for e in every} == {"fp32"}
    only = json.loads(invoke("plan", "--profile", saved, "--gpus", 4, "--json", "--top", 1000,
                             "--data-parallel", "replicate").stdout)
    assert {e["data_parallel_mode"] for e in only} == {"replicate"}
    refused = invoke("plan", "--profile", saved, "--gpus", 4, "--precision", "bf16")
    assert refused.exit_code == 2, refused.output
    assert f"{saved} was profiled in fp32, not bf16; profile again with" in " ".join(refused.stderr.split())


def test_profile_in_bf16_then_plan_in_bf16(model, tmp_path):
    saved = tmp_path / "bf16.json"
    result = invoke("profile", model, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--precision", "bf16",
                    "-M", 4, "--output", saved)
    assert result.exit_code == 0, result.output
    assert json.loads(saved.read_text())["precision"] == "bf16"
    planned = json.loads(invoke("plan", "--profile", saved, "--gpus", 2, "--json", "--precision", "bf16").stdout)
    assert planned and {e["precision"] for e in planned} == {"bf16"}
    table = invoke("plan", "--profile", saved, "--gpus", 2)
    assert "plan: 2 ranks, batch 8, bf16" in " ".join(table.stdout.split())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", 2, "--gpus-per-node", 2, "--gpus", 8], "--gpus 8 is not --nodes 2 x --gpus-per-node 2"),
        (["--gpus", 6, "--gpus-per-node", 4], "not a whole number of nodes of 4"),
        (["--nodes", 2], "--nodes needs --gpus-per-node"),
        ([], "pass --gpus, or --nodes and --gpus-per-node"),
    ],
)
def test_plan_node_flags_are_checked(tmp_path, args, message):
    saved = tmp_path / "profile.json"
    saved.write_text("{}")
    result = invoke("plan", "--profile", saved, *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("content, message", [(None, "no profile at"), ("not json", "cannot read profile"),
                                              ("[1]", "is not a profile"), ("{}", "cannot read profile")])
def test_plan_from_a_bad_profile_is_one_line(tmp_path, content, message):
    saved = tmp_path / "profile.json"
    if content is not None:
        saved.write_text(content)
    result = invoke("plan", "--profile", saved, "--gpus", 2, "--batch-size", 8)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_plan_ranks_tensor_parallel_layouts_of_a_model_with_a_plan_and_says_what_they_cost(tmp_path):
    """The Llama recipe's own plan allows tp 2 on 2 GPUs: the JSON lists pp 1 x dp 1 x tp 2 with the time of its
    collectives, the table closes with what tp 2 costs; from a saved profile, --tensor-parallel asks for it."""
    pytest.importorskip("transformers")
    from tests.conftest import RECIPES

    args = ("--gpus", 2, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--micro-batch-size", "4,8")
    result = invoke("plan", RECIPES / "hf_llama.py", *args, "--top", 200, "--json")
    assert result.exit_code == 0, result.output
    tp = [e for e in json.loads(result.stdout) if e["tensor_parallel_degree"] == 2]
    assert tp and all(e["pipeline_degree"] * e["data_parallel_degree"] == 1 for e in tp)
    assert all(e["predicted_tensor_parallel_ms"] > 0 for e in tp)
    table = invoke("plan", RECIPES / "hf_llama.py", *args)
    assert "tensor parallel 2: best tp2/" in table.stdout and "tp collectives" in table.stdout
    saved = tmp_path / "profile.json"
    assert invoke("profile", RECIPES / "hf_llama.py", "--batch-size", 8, "--device", "cpu", "--repeats", 1,
                  "--micro-batch-size", "4,8", "--output", saved).exit_code == 0
    assert json.loads(saved.read_text())["tensor_parallel_layers"][1]["backward_all_reduces"] == 5
    from_profile = invoke("plan", "--profile", saved, "--gpus", 2, "--tensor-parallel", "1,2", "--top", 200,
                          "--json")
    assert from_profile.exit_code == 0, from_profile.output
    assert any(e["tensor_parallel_degree"] == 2 for e in json.loads(from_profile.stdout))
    refused = invoke("plan", "--profile", saved, "--gpus", 2, "--tensor-parallel", "4")
    assert refused.exit_code == 2 and "does not divide the 2 GPUs" in refused.output


def test_plan_ranks_2bw_only_with_allow_async(model):
    """2BW changes the optimizer's semantics: `plan` ranks it only with --allow-async (and only with a pipeline)."""
    args = ("plan", model, "--gpus", 2, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--json", "--top", 1000)
    without = json.loads(invoke(*args).stdout)
    assert without and not any(entry["schedule"] == "2BW" for entry in without)
    result = invoke(*args, "--allow-async")
    assert result.exit_code == 0, result.output
    with_async = [entry for entry in json.loads(result.stdout) if entry["schedule"] == "2BW"]
    assert with_async and all(entry["pipeline_degree"] == 2 for entry in with_async)
