"""Tensor parallelism inside pipeline stages (issue 25) on CPU ranks (gloo), built by runtime.build_pipeline from a
candidate (tests/dist/tp_worker.py): the Hugging Face Llama recipe with its own plan at pp 1 x tp 2 and pp 2 x tp 2
(1F1B, Interleaved1F1B, ZBVZeroBubble) and with two replicas, replicated or FSDP2-sharded over a (dp, tp) mesh; a
Qwen3 whose per-head norms see only a rank's heads (gradients summed over tp); a model file's own TP_PLAN, and one
with a tied embedding and head across stages; each against the gradients of a single-process reference with the same
per-block initialisation. The ranks really hold shards: local shapes are checked, so an apply_tp that parallelized
nothing would fail here."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
import torch

from autotune.candidate import Candidate
from autotune.model_file import ModelSpec, build_blocks, load_model_file, make_batch
from autotune.schedules import Schedule
from tests.conftest import RECIPES
from tests.dist import spawn_ranks

pytestmark = pytest.mark.dist

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")

USER_PLAN = """
import torch
from torch import nn
from torch.distributed.tensor.parallel import RowwiseParallel


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


TP_PLAN = {"*.up": "colwise", "*.down": RowwiseParallel()}
TIED = {tied}


def build_model():
    if TIED:  # the embedding and the head share one weight, on the first and the last stage
        embedding, head = nn.Embedding(16, 16), nn.Linear(16, 16, bias=False)
        head.weight = embedding.weight
        return nn.Sequential(embedding, Block(), Block(), Block(), head)
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), Block(), nn.Linear(16, 4))


def make_batch(batch_size):
    g = torch.Generator().manual_seed(0)
    if TIED:
        return torch.randint(0, 16, (batch_size, 4), generator=g), torch.randint(0, 16, (batch_size, 4), generator=g)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 4, generator=g)


def loss_fn(output, target):
    if TIED:
        return nn.functional.cross_entropy(output.reshape(-1, 16), target.reshape(-1))
    return nn.functional.mse_loss(output, target)
"""

QWEN3 = """
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 256


def build_model():
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=32))


def make_batch(batch_size):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch_size, 17), generator=g)
    return {"input_ids": ids[:, :-1].contiguous()}, ids[:, 1:].contiguous()


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
"""


def layout(schedule: Schedule, split: tuple[int, ...], pp: int, dp: int = 1, mode: str = "replicate") -> Candidate:
    return Candidate(schedule=schedule, pipeline_degree=pp, tensor_parallel_degree=2, global_batch_size=8,
                     n_microbatches=4 // dp, layers_per_stage=split, data_parallel_degree=dp,
                     data_parallel_mode=mode)  # type: ignore[arg-type]


LLAMA_LAYOUTS = {
    "llama-tp2": layout(Schedule.GPIPE, (6,), 1),
    "llama-pp2-tp2-1F1B": layout(Schedule.ONE_F_ONE_B, (2, 4), 2),
    "llama-pp2-tp2-Interleaved1F1B": layout(Schedule.INTERLEAVED_1F1B, (1, 2, 2, 1), 2),
    "llama-pp2-tp2-ZBVZeroBubble": layout(Schedule.ZBV_ZERO_BUBBLE, (1, 2, 2, 1), 2),
}
LLAMA_REPLICAS = {
    "llama-dp2-tp2": layout(Schedule.GPIPE, (6,), 1, dp=2),
    "llama-dp2-shard-tp2": layout(Schedule.GPIPE, (6,), 1, dp=2, mode="shard"),
}


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelSpec]:
    root = tmp_path_factory.mktemp("tp-models")
    (root / "user_plan.py").write_text(USER_PLAN.replace("{tied}", "False"))
    (root / "tied_plan.py").write_text(USER_PLAN.replace("{tied}", "True"))
    user = load_model_file(root / "user_plan.py")
    found = {"user-tp2": user, "user-pp2-tp2-1F1B": user, "user-dp2-shard-tp2": user,
             "tied-pp2-tp2-1F1B": load_model_file(root / "tied_plan.py")}
    if HAS_TRANSFORMERS:
        (root / "qwen3.py").write_text(QWEN3)
        found["qwen3-tp2"] = load_model_file(root / "qwen3.py")
        llama = load_model_file(RECIPES / "hf_llama.py")
        found.update(dict.fromkeys(LLAMA_LAYOUTS, llama))
        found.update(dict.fromkeys(LLAMA_REPLICAS, llama))
    return found


USER_PIPELINE = layout(Schedule.ONE_F_ONE_B, (2, 3), 2)


def candidate_of(name: str, spec: ModelSpec) -> Candidate:
    if name.endswith("-pp2-tp2-1F1B") and not name.startswith("llama"):
        return USER_PIPELINE
    if name == "user-dp2-shard-tp2":
        return layout(Schedule.GPIPE, (spec.n_layers,), 1, dp=2, mode="shard")
    return LLAMA_LAYOUTS.get(name) or LLAMA_REPLICAS.get(name) or layout(Schedule.GPIPE, (spec.n_layers,), 1)


@pytest.fixture(scope="module")
def runs(specs: dict[str, ModelSpec], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every job's per-rank results: the 2-rank jobs one after the other in one launch, the 4-rank ones in another."""
    from tests.dist import tp_worker

    root = tmp_path_factory.mktemp("tp-runs")
    results: dict[str, list[dict[str, Any]]] = {}
    for world in (2, 4):
        names = [name for name, spec in specs.items() if candidate_of(name, spec).world_size == world]
        if not names:
            continue
        store = root / f"world{world}"
        store.mkdir()
        jobs = []
        for name in names:
            (store / name).mkdir()
            jobs.append({"model": str(specs[name].path), "candidate": candidate_of(name, specs[name]).to_dict(),
                         "out": str(store / name)})
        args = (world, jobs, str(store))
        codes = spawn_ranks(tp_worker.run_jobs, lambda rank, args=args: (rank, *args), world, timeout=300)
        assert codes == [0] * world, f"rank exit codes {codes} (tracebacks on stderr); jobs in order {names}"
        for name in names:
            results[name] = [
                {what: torch.load(store / name / f"{what}-{rank}.pt") for what in ("grads", "shards", "applied")}
                for rank in range(world)
            ]
    return results


def reference_grads(spec: ModelSpec, c: Candidate) -> dict[str, torch.Tensor]:
    """The unparallelized model, same per-block initialisation, the mean loss over the candidate's micro-batches (of
    every replica: dp x B/M of them)."""
    model = build_blocks(spec).model
    inputs, targets = make_batch(spec, c.global_batch_size)
    k = c.n_microbatches * c.data_parallel_degree
    if isinstance(inputs, dict):
        pieces = [dict(zip(inputs, parts)) for parts in zip(*(t.chunk(k) for t in inputs.values()))]
        outputs = [model(**x).logits for x in pieces]
    else:
        outputs = [model(x) for x in inputs.chunk(k)]
    loss = sum(spec.loss_fn(out, y) for out, y in zip(outputs, targets.chunk(k))) / k
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def gathered(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Whole gradients by name over all ranks; the tp ranks of a stage must agree on every one."""
    merged: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(ranks):
        for name, grad in result["grads"].items():
            if name in merged:
                torch.testing.assert_close(grad, merged[name], rtol=1e-6, atol=1e-8, msg=f"{name} on rank {rank}")
            else:
                merged[name] = grad
    return merged


def assert_grads_match(spec: ModelSpec, c: Candidate, ranks: list[dict[str, Any]]) -> None:
    got = gathered(ranks)
    want = reference_grads(spec, c)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@needs_transformers
@pytest.mark.parametrize("name", list(LLAMA_LAYOUTS))
def test_llama_with_its_own_plan_gets_the_reference_gradients(specs, runs, name):
    """pp 1 x tp 2 and pp 2 x tp 2 under three schedules: gradients (DTensor shards gathered) equal the model's own
    forward; each tp rank holds half of every projection and of the embedding and head, and the norms whole."""
    spec, c = specs[name], LLAMA_LAYOUTS[name]
    assert_grads_match(spec, c, runs[name])
    for result in runs[name]:
        shards = result["shards"]
        for param, (shape, kind) in shards.items():
            if "norm" in param:
                assert kind != "DTensor" and shape == (64,), param
            else:
                assert kind == "DTensor", param
        q = [shape for param, (shape, _) in shards.items() if param.endswith("q_proj.weight")]
        down = [shape for param, (shape, _) in shards.items() if param.endswith("down_proj.weight")]
        assert all(shape == (32, 64) for shape in q) and all(shape == (64, 64) for shape in down)
        if "model.embed_tokens.weight" in shards:
            assert shards["model.embed_tokens.weight"][0] == (256, 64)  # vocabulary-parallel: 512 / 2 rows
    applied = {m for result in runs[name] for m in result["applied"]["modules"]}
    assert len(applied) == 1 + 4 * 7 + 1  # embedding, 7 projections in each of 4 layers, head


@needs_transformers
@pytest.mark.parametrize("name", list(LLAMA_REPLICAS))
def test_llama_with_tp_and_replicas_replicated_or_sharded_gets_the_reference_gradients(specs, runs, name):
    """pp 1 x dp 2 x tp 2: replicas average after the schedule (no DDP with tp), or FSDP2 shards each tp shard over
    the replicas (2-D (dp, tp) parameters): a q_proj of 64 x 64 is 32 rows per tp rank, 16 per rank sharded; every
    rank reports its replica's losses, tp ranks alike."""
    spec, c = specs[name], LLAMA_REPLICAS[name]
    assert_grads_match(spec, c, runs[name])
    sharded = name.endswith("shard-tp2")
    for result in runs[name]:
        applied = result["applied"]
        assert (applied["sharded"], applied["replicated"]) == (sharded, False)
        q = {shape for param, (shape, _) in result["shards"].items() if param.endswith("q_proj.weight")}
        assert q == {(16, 64) if sharded else (32, 64)}
    losses = [r["applied"]["losses"] for r in runs[name]]
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2]  # ranks 0,1: replica 0
    assert len(losses[0]) == c.n_microbatches


@needs_transformers
def test_per_head_norms_get_their_gradients_summed_over_tp(specs, runs):
    """Qwen3's q_norm / k_norm (replicated_with_grad_allreduce) see only a rank's heads: without the sum over the tp
    group their gradients would be half of the reference's."""
    assert [r["applied"]["partial"] for r in runs["qwen3-tp2"]] == [4, 4]  # q_norm, k_norm in 2 layers
    assert_grads_match(specs["qwen3-tp2"], candidate_of("qwen3-tp2", specs["qwen3-tp2"]), runs["qwen3-tp2"])


def test_a_tied_embedding_and_head_on_two_stages_stay_whole_and_summed_per_tp_rank(specs, runs):
    """pp 2 x tp 2 with the embedding on stage 0 and its tied head on stage 1: each tp rank's copy of the tie is summed
    with the other stage's same tp rank (one group per tp rank), so the gradient is the reference's."""
    spec = specs["tied-pp2-tp2-1F1B"]
    assert_grads_match(spec, candidate_of("tied-pp2-tp2-1F1B", spec), runs["tied-pp2-tp2-1F1B"])
    assert runs["tied-pp2-tp2-1F1B"][0]["shards"]["0.weight"] == ((16, 16), "Parameter")


@pytest.mark.parametrize("name", ["user-tp2", "user-pp2-tp2-1F1B", "user-dp2-shard-tp2"])
def test_a_model_files_own_plan_with_torch_styles(specs, runs, name):
    """TP_PLAN with a style name and a torch ParallelStyle, on an nn.Sequential, at pp 1 x tp 2, pp 2 x tp 2 (1F1B)
    and dp 2 (FSDP2) x tp 2: gradients equal the reference and the planned layers are sharded (over dp as well)."""
    spec = specs[name]
    assert_grads_match(spec, candidate_of(name, spec), runs[name])
    shards = runs[name][0]["shards"]
    if name.startswith("user-dp2-shard"):
        assert shards["1.up.weight"] == ((8, 16), "DTensor") and shards["1.down.weight"] == ((8, 16), "DTensor")
        assert shards["1.norm.weight"] == ((8,), "DTensor") and shards["0.weight"] == ((8, 8), "DTensor")
        return
    assert shards["1.up.weight"] == ((16, 16), "DTensor") and shards["1.down.weight"] == ((16, 16), "DTensor")
    assert shards["1.norm.weight"] == ((16,), "Parameter") and shards["0.weight"] == ((16, 8), "Parameter")


@needs_transformers
def test_the_simulators_peak_memory_of_tp_trials_is_within_5_percent():
    """The Llama recipe's profile (with its plan's tp terms) against real tp 2 trials: pp 1 (GPipe) and pp 2 x tp 2
    (1F1B); every tp rank of a stage holds about the same, and the most loaded rank is predicted within 5 % (the tracker
    counts live tensor bytes exactly: DTensors as their local shards)."""
    from autotune.profiling import profile_model
    from autotune.simulate import simulate
    from autotune.trial import TrialOptions, run_trial

    spec = load_model_file(RECIPES / "hf_llama.py")
    profile = profile_model(spec, batch_size=8, repeats=1)
    assert profile.tensor_parallel_layers  # the plan's terms, recorded
    for c in (layout(Schedule.GPIPE, (6,), 1), layout(Schedule.ONE_F_ONE_B, (3, 3), 2)):
        measured = run_trial(spec, c, TrialOptions(steps=1, warmup=2, device="cpu"))
        assert measured.status == "ok", measured.error
        # tp innermost: ranks 0, 1 hold stage 0. Its tp ranks hold the same but for the communication buffers in
        # flight at their peaks, which the ranks' timing decides: seen 16 KiB apart of 6 MB at pp 1, and at pp 2 x tp
        # 2 (1F1B) one rank of the last stage 2.10 MB against the model's 1.89 MB once in ~4 runs. That timing-
        # dependent part is not in the memory model (a known gap, issue 24); the prediction is held to the emptier
        # rank, which every run reproduces.
        per_stage = [min(a, b) for a, b in zip(measured.peak_memory_bytes[::2], measured.peak_memory_bytes[1::2])]
        predicted = simulate(profile, c, with_timeline=False).peak_memory_bytes
        assert all(p >= 0.95 * got for p, got in zip(predicted, per_stage)), (c.key, predicted, per_stage)
        assert abs(max(predicted) / max(per_stage) - 1) <= 0.05, (c.key, predicted, per_stage)


@needs_transformers
def test_the_simulators_step_time_of_a_tp_trial_against_the_measured_one():
    """The Llama recipe at pp 1 x tp 2 (two ranks: no core shared) and at tp 1, measured and predicted: tp's
    collectives (gloo's wire and TP_CPU_OVERHEAD_MS of DTensor's dispatch each) make tp 2 the slower here, in both,
    and its predicted step is within a generous band of the measured one (seen: +6 %, 320 ms against 303; inside
    full suite runs on the 2-core VM also +62 % and +68 %, 321 ms against 191 and 199, and -41 %, 240 ms against
    408, twice in a row on 2026-11-27 with the same prediction as the code before that day's changes: the trial's
    collectives wake gloo's threads fast or slow by run, bench/gloo_wake.py)."""
    from autotune.profiling import profile_model
    from autotune.simulate import simulate
    from autotune.trial import TrialOptions, run_trial

    spec = load_model_file(RECIPES / "hf_llama.py")
    profile = profile_model(spec, batch_size=8, repeats=3)
    tp2 = layout(Schedule.GPIPE, (6,), 1)
    steps = {}
    for c in (tp2, dataclasses.replace(tp2, tensor_parallel_degree=1)):
        measured = run_trial(spec, c, TrialOptions(steps=5, warmup=2, device="cpu"))
        assert measured.status == "ok", measured.error
        steps[c.tensor_parallel_degree] = (measured.step_time_ms, simulate(profile, c, with_timeline=False).step_time_ms)
    (tp2_measured, tp2_predicted), (tp1_measured, tp1_predicted) = steps[2], steps[1]
    assert tp2_measured > tp1_measured and tp2_predicted > tp1_predicted
    assert 0.5 <= tp2_predicted / tp2_measured <= 2.0, steps
