"""`autotune trial`: exit codes, one-line errors without tracebacks, and the JSON it prints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from tests.conftest import RECIPES
from tests.fakes import TINY_MODEL as GOOD

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def trial_args(path, *extra):
    return [
        "trial",
        path,
        "--gpus",
        "2",
        "--device",
        "cpu",
        "--batch-size",
        "8",
        "--microbatches",
        "2",
        "--schedule",
        "GPipe",
        *extra,
    ]


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    text = " ".join(lines)
    assert text.startswith("error:")
    for fragment in fragments:
        assert fragment in text, text


@pytest.mark.parametrize(
    "source,fragments",
    [
        ("import torch\ndef build_model(:\n", ["model.py:2", "SyntaxError"]),
        ("import torch\nraise RuntimeError('cannot import here')\n", ["model.py:2", "cannot import here"]),
        (GOOD.replace("def loss_fn", "def other_fn"), ["no function loss_fn()", "add loss_fn"]),
        (
            GOOD.replace("return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))", "return 42"),
            ["build_model() returned an int", "return an nn.Module", "recipes/hf_llama.py"],
        ),
        (
            GOOD.replace(
                "return torch.randn(batch_size, 4), torch.randn(batch_size, 2)", "return torch.randn(batch_size, 4)"
            ),
            ["make_batch(8) returned a tensor", "(inputs, targets)"],
        ),
        (
            GOOD.replace(
                "torch.randn(batch_size, 4), torch.randn(batch_size, 2)", "torch.randn(3, 4), torch.randn(3, 2)"
            ),
            ["inputs of shape (3, 4)", "must be the batch size asked for (8)"],
        ),
        (
            GOOD.replace("nn.functional.mse_loss(output, target)", "(output - target) ** 2"),
            ["loss_fn(output, target) returned a tensor of shape (2, 2)", "scalar"],
        ),
        (
            GOOD.replace(
                "    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))",
                "    raise ValueError('bad width')",
            ),
            ["model.py:5", "build_model raised ValueError: bad width"],
        ),
    ],
    ids=[
        "syntax",
        "import-raises",
        "missing-function",
        "not-sequential",
        "batch-not-tuple",
        "batch-dim",
        "loss-not-scalar",
        "build-raises",
    ],
)
def test_broken_model_files_exit_2_with_one_line(tmp_path, source, fragments):
    path = tmp_path / "model.py"
    path.write_text(source)
    one_line_error(invoke(*trial_args(path)), *fragments)


def test_missing_model_file(tmp_path):
    one_line_error(invoke(*trial_args(tmp_path / "nope.py")), "no such file")


@pytest.mark.parametrize(
    "extra,fragment",
    [
        (["--microbatches", "3"], "cannot be cut into 1 replica(s) x 3"),
        (["--schedule", "1F1B", "--microbatches", "1"], "at least as many micro-batches as stages"),
        (["--layers-per-stage", "1,1"], "covers 2 layers but the model has 3"),
        (["--schedule", "ZBVZeroBubble", "--layers-per-stage", "2,1"], "exactly 2 stage(s) per rank"),
        (["--gpus", "4"], "need at least 4 layers but the model has 3"),
        (["--schedule", "PipeDream"], "unknown schedule"),
        (["--layers-per-stage", "a,b"], "cannot read --layers-per-stage"),
        (["--memory-limit", "lots"], "cannot read size"),
        (["--data-parallel", "shard"], "--data-parallel shard needs --dp 2 or more"),
        (["--dp", "2", "--reshard-after-forward"], "--reshard-after-forward applies to --data-parallel shard only"),
        (["--tensor-parallel", "2"], "tensor_parallel_degree 2 needs a tensor-parallel plan: "),
        (["--dp", "2", "--tensor-parallel", "2"], "--gpus 2 is not a multiple of --dp 2 x --tensor-parallel 2"),
    ],
)
def test_invalid_candidates_are_refused_before_launch(tmp_path, extra, fragment):
    path = tmp_path / "model.py"
    path.write_text(GOOD)
    one_line_error(invoke(*trial_args(path, *extra)), fragment)


def test_cuda_without_a_gpu_says_use_cpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = tmp_path / "model.py"
    path.write_text(GOOD)
    result = invoke("trial", path, "--gpus", "2", "--batch-size", "8", "--microbatches", "2", "--schedule", "GPipe")
    assert result.exit_code == 4
    assert "--device cpu" in result.output


@pytest.mark.dist
def test_trial_json_in_a_real_subprocess():
    """The installed entry point, as a user runs it: one JSON object on stdout, nothing else."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.cli",
            "trial",
            RECIPES / "gpt.py",
            "--gpus",
            "2",
            "--device",
            "cpu",
            "--batch-size",
            "16",
            "--microbatches",
            "4",
            "--schedule",
            "Interleaved1F1B",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in (
        "status",
        "step_time_ms",
        "throughput_samples_per_s",
        "peak_memory_bytes",
        "schedule",
        "num_microbatches",
        "micro_batch_size",
        "layers_per_stage",
        "error",
    ):
        assert key in data
    assert data["status"] == "ok" and data["error"] is None
    assert data["layers_per_stage"] == [2, 2, 2, 2] and len(data["peak_memory_bytes"]) == 2
    # every step trained has its loss (1 warm-up, 1 untracked, 2 timed); each trains weights the last one updated
    losses = data["losses"]
    assert len(losses) == 4 and losses[-1] == pytest.approx(data["loss"]) and losses[1] != losses[0]


@pytest.mark.dist
def test_failed_trial_exit_code_and_json(model_file):
    path = model_file("if os.environ.get('RANK') == '1':\n    torch.empty(2**50)")
    result = invoke(*trial_args(path, "--json"))
    assert result.exit_code == 3
    data = json.loads(result.stdout)
    assert data["status"] == "oom" and data["error"]["rank"] == 1


@pytest.mark.dist
def test_a_sharded_bf16_trial_runs_with_its_state_split_over_the_replicas():
    """--data-parallel shard on pp 2 x dp 2 (FSDP2, bf16 mixed precision, resharding after forward): it runs, says so
    in its JSON, and rank 0's peak stays below what its stage's whole state takes (parameters, gradients and AdamW's
    two moments: 16 bytes a parameter), which every replicate layout holds."""
    from autotune.candidate import stage_bounds, uniform_split
    from autotune.model_file import build_blocks, load_model_file

    result = invoke("trial", RECIPES / "mlp.py", "--gpus", "4", "--dp", "2", "--device", "cpu", "--batch-size", "32",
                    "--microbatches", "4", "--schedule", "1F1B", "--steps", "1", "--warmup", "1", "--data-parallel",
                    "shard", "--reshard-after-forward", "--precision", "bf16", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["status"] == "ok", data["error"]
    layout = (data["data_parallel_mode"], data["fsdp_reshard_after_forward"], data["precision"])
    assert layout == ("shard", True, "bf16")
    assert data["wire_grad_rel_error"] is None and len(data["peak_memory_bytes"]) == 4
    spec = load_model_file(RECIPES / "mlp.py")
    bounds = stage_bounds(uniform_split(spec.n_layers, 2))
    blocks = build_blocks(spec).blocks[bounds[0]:bounds[1]]
    whole_state = 16 * sum(p.numel() for block in blocks for p in block.parameters())
    assert 0 < data["peak_memory_bytes"][0] < whole_state
    assert data["peak_memory_bytes"][0] == data["peak_memory_bytes"][2]  # replicas hold alike



@pytest.mark.dist
def test_a_tensor_parallel_trial_trains_as_one_rank_does_on_half_the_state():
    """--tensor-parallel 2 on the Hugging Face Llama recipe (its own plan): the same losses as one rank training the
    whole model (same initialisation, same batches), and each rank's peak below that rank's (its projections,
    embedding and head, their gradients and AdamW moments are halves)."""
    pytest.importorskip("transformers")
    args = ["--device", "cpu", "--batch-size", "8", "--microbatches", "2", "--schedule", "GPipe", "--steps", "1",
            "--warmup", "1", "--json"]
    result = invoke("trial", RECIPES / "hf_llama.py", "--gpus", "2", "--tensor-parallel", "2", *args)
    assert result.exit_code == 0, result.output
    tp = json.loads(result.stdout)
    assert tp["status"] == "ok", tp["error"]
    assert (tp["pipeline_degree"], tp["data_parallel_degree"], tp["tensor_parallel_degree"]) == (1, 1, 2)
    one = json.loads(invoke("trial", RECIPES / "hf_llama.py", "--gpus", "1", *args).stdout)
    assert one["status"] == "ok", one["error"]
    assert tp["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert len(tp["peak_memory_bytes"]) == 2 and max(tp["peak_memory_bytes"]) < one["peak_memory_bytes"][0]


def test_2bw_needs_allow_async_and_replicated_replicas(model_file):
    """2BW trains with one-step-stale updates: refused without --allow-async, and over FSDP2-sharded replicas, each
    in one line naming the fix, before any rank starts."""
    path = model_file()
    one_line_error(invoke(*trial_args(path)[:-1], "2BW"), "2BW is asynchronous", "pass --allow-async")
    sharded = invoke(*trial_args(path)[:-1], "2BW", "--allow-async", "--gpus", "4", "--dp", "2",
                     "--data-parallel", "shard")
    one_line_error(sharded, "does not run with FSDP2-sharded replicas", "--data-parallel replicate")


TIED = """
import torch
from torch import nn

def build_model():
    first, last = nn.Linear(8, 8), nn.Linear(8, 8)
    last.weight = first.weight  # tied between the first and the last block, as GPT-2's embedding and head
    return nn.Sequential(first, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), last)

def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 8)

def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""


def test_2bw_refuses_a_model_with_tied_parameters_and_plan_leaves_it_out(tmp_path):
    """Tied copies on two pipeline ranks would need their delayed updates kept in step (a 2BW trial of tied GPT-2
    hung): the trial is refused in one line before any rank starts, and plan --allow-async warns and plans the
    synchronous schedules only."""
    path = tmp_path / "tied.py"
    path.write_text(TIED)
    one_line_error(invoke(*trial_args(path)[:-1], "2BW", "--allow-async"), "tied between blocks",
                   "use a synchronous schedule")
    planned = invoke("plan", path, "--gpus", 2, "--batch-size", 8, "--device", "cpu", "--repeats", 1, "--json",
                     "--top", 1000, "--allow-async")
    assert planned.exit_code == 0, planned.output
    assert "tied between blocks" in " ".join(planned.stderr.split())  # a terminal may wrap it
    entries = json.loads(planned.stdout)
    assert entries and not any(entry["schedule"] == "2BW" for entry in entries)


@pytest.mark.dist
def test_a_2bw_trial_runs_its_timed_steps_as_one_window():
    """--allow-async --schedule 2BW on pp 2: it runs, the JSON names the schedule, and the timed steps are one
    measurement (one window: the pipeline filled and drained once over the 3 steps), and every step it trained has
    its loss: 1 warm-up step, the untracked window of 3 and the timed one, the first two on the same weights W(0)
    (W(t+1) = W(t) - lr * grad f(W(t-1)), W(-1) = W(0)), the third on W(1)."""
    result = invoke("trial", RECIPES / "mlp.py", "--gpus", "2", "--device", "cpu", "--batch-size", "16",
                    "--microbatches", "4", "--schedule", "2BW", "--allow-async", "--steps", "3", "--warmup", "1",
                    "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["status"] == "ok", data["error"]
    assert data["schedule"] == "2BW" and len(data["step_times_ms"]) == 1 and data["loss"] > 0
    losses = data["losses"]
    assert len(losses) == 7 and losses[-1] == pytest.approx(data["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] != pytest.approx(losses[1], rel=1e-6)
