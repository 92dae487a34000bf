"""Real models as they are (issue 12), on 2 CPU ranks (gloo): a tied GPT-2 (recipes/hf_gpt2.py) pipelined under every
schedule family and with data parallelism gets the gradients of the model's own forward, its tied weight stays one
parameter (one optimizer entry per rank, equal copies on the ranks holding it) and 8 optimizer steps end at the
data-parallel layout's loss; a Llama whose batch pads some sequences (recipes/hf_llama.py) and a BERT with its MLM
decoder tied to its embedding (recipes/hf_bert.py) get exact gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autotune.candidate import Candidate, uniform_split
from autotune.model_file import ModelSpec, build_blocks, build_optimizer, load_model_file, make_batch
from autotune.schedules import Schedule, default_stages_per_rank
from tests.conftest import RECIPES
from tests.dist import Runs, gathered, spawn_ranks

pytest.importorskip("transformers")

pytestmark = pytest.mark.dist

STEPS = 8
TIED = "transformer.wte.weight"  # GPT-2's token embedding; lm_head.weight is the same Parameter

# The recipe as it is, with dropout off: the reference and the pipeline then draw no random numbers, so gradients
# and losses can be compared exactly.
NO_DROPOUT = """
import importlib.util
from torch import nn

_spec = importlib.util.spec_from_file_location("recipe_{name}", {recipe!r})
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)
make_batch, loss_fn = recipe.make_batch, recipe.loss_fn


def build_model():
    model = recipe.build_model()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model
"""


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    path = tmp_path_factory.mktemp("gpt2") / "gpt2.py"
    path.write_text(NO_DROPOUT.format(name="hf_gpt2", recipe=str(RECIPES / "hf_gpt2.py")))
    return load_model_file(path)


@pytest.fixture(scope="module")
def llama() -> ModelSpec:
    return load_model_file(RECIPES / "hf_llama.py")


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    path = tmp_path_factory.mktemp("bert") / "bert.py"
    path.write_text(NO_DROPOUT.format(name="hf_bert", recipe=str(RECIPES / "hf_bert.py")))
    return load_model_file(path)


# the embeddings and layer 0 on rank 0; layers 1-3 and the MLM head, whose decoder is the word embedding, on rank 1
BERT_1F1B = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=8, n_microbatches=4,
                      layers_per_stage=(2, 4))
LLAMA_1F1B = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=8, n_microbatches=4,
                       layers_per_stage=(2, 4))


def candidate(spec: ModelSpec, schedule: Schedule, *, pp: int = 2, dp: int = 1, m: int = 4, **more: Any) -> Candidate:
    """16 samples in dp x m = 4 micro-batches of 4 in every layout: one loss, one gradient, one trajectory. more:
    other Candidate fields (data_parallel_mode, reshard_after_forward, precision)."""
    stages = pp * default_stages_per_rank(schedule)
    return Candidate(schedule=schedule, pipeline_degree=pp, data_parallel_degree=dp, global_batch_size=16,
                     n_microbatches=m, layers_per_stage=uniform_split(spec.n_layers, stages), **more)


GPT2_LAYOUTS = {
    "GPipe": dict(schedule=Schedule.GPIPE),
    "1F1B": dict(schedule=Schedule.ONE_F_ONE_B),  # embedding on rank 0, head on rank 1: the tied gradient all-reduced
    "Interleaved1F1B": dict(schedule=Schedule.INTERLEAVED_1F1B),
    "ZBVZeroBubble": dict(schedule=Schedule.ZBV_ZERO_BUBBLE),  # stages 0 and 3 on rank 0: both uses on one rank
    "VHalf": dict(schedule=Schedule.V_HALF),
    "dp2": dict(schedule=Schedule.GPIPE, pp=1, dp=2, m=2),
    "pp2xdp2": dict(schedule=Schedule.ONE_F_ONE_B, dp=2, m=2),
    # FSDP2 over the replicas (autotune.sharding). pp 1: both uses of the tied weight in one rank's stage, where
    # FSDP2 leaves it whole; 1F1B and Interleaved1F1B: its shards on two ranks, summed; ZBV and VHalf: both uses on
    # rank 0. Some reshard after each forward (VHalf's and ZBV's split backwards need compat's unshard before I/W).
    "dp2-shard": dict(schedule=Schedule.GPIPE, pp=1, dp=2, m=2, data_parallel_mode="shard"),
    **{f"pp2xdp2-shard-{name}": dict(schedule=schedule, dp=2, m=2, data_parallel_mode="shard", reshard_after_forward=r)
       for name, schedule, r in [("GPipe", Schedule.GPIPE, False), ("1F1B", Schedule.ONE_F_ONE_B, True),
                                 ("Interleaved1F1B", Schedule.INTERLEAVED_1F1B, False),
                                 ("ZBVZeroBubble", Schedule.ZBV_ZERO_BUBBLE, True), ("VHalf", Schedule.V_HALF, True),
                                 ("VHalf-keep", Schedule.V_HALF, False)]},
}


def chunks(inputs: Any, k: int) -> list[Any]:
    """make_batch's inputs (a tensor, tuple or dict) cut into k micro-batches along dim 0."""
    if isinstance(inputs, torch.Tensor):
        return list(inputs.chunk(k))
    if isinstance(inputs, dict):
        return [dict(zip(inputs, parts)) for parts in zip(*(t.chunk(k) for t in inputs.values()))]
    return [tuple(parts) for parts in zip(*(t.chunk(k) for t in inputs))]


def forward(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    """The model's own forward on make_batch's inputs; a Hugging Face output gives its logits."""
    if isinstance(inputs, dict):
        out = model(**inputs)
    elif isinstance(inputs, tuple):
        out = model(*inputs)
    else:
        out = model(inputs)
    return getattr(out, "logits", out)


def batch_loss(spec: ModelSpec, model: torch.nn.Module, c: Candidate) -> torch.Tensor:
    """The training loss as the pipeline defines it: the mean over replicas and micro-batches of loss_fn."""
    inputs, targets = make_batch(spec, c.global_batch_size)
    k = c.n_microbatches * c.data_parallel_degree
    return sum(spec.loss_fn(forward(model, x), y) for x, y in zip(chunks(inputs, k), targets.chunk(k))) / k


def reference_grads(spec: ModelSpec, c: Candidate) -> dict[str, torch.Tensor]:
    model = build_blocks(spec).model
    batch_loss(spec, model, c).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs(gpt2: ModelSpec, llama: ModelSpec, bert: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    jobs = {name: (gpt2, candidate(gpt2, **layout), STEPS) for name, layout in GPT2_LAYOUTS.items()}
    jobs["llama"] = (llama, LLAMA_1F1B, 0)
    jobs["bert"] = (bert, BERT_1F1B, 0)
    return Runs(jobs, tmp_path_factory.mktemp("runs"))


def step_losses(ranks: list[dict[str, Any]]) -> list[float]:
    """The loss before each step: the mean of every micro-batch loss of every replica's last stage."""
    per_step = zip(*(result["losses"] for result in ranks))
    return [sum(sum(r) for r in step) / sum(len(r) for r in step) for step in per_step]


def loss_of(spec: ModelSpec, params: dict[str, torch.Tensor]) -> float:
    """The model's own loss on the batch with these parameter values."""
    model = build_blocks(spec).model
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
        return float(batch_loss(spec, model, candidate(spec, **GPT2_LAYOUTS["dp2"])))


@pytest.fixture(scope="module")
def trained_reference(gpt2: ModelSpec) -> tuple[float, float]:
    """(loss before, loss after) STEPS optimizer steps of the unpipelined model on the same batch."""
    model = build_blocks(gpt2).model
    optimizer = build_optimizer(gpt2, list(model.parameters()))
    c = candidate(gpt2, **GPT2_LAYOUTS["dp2"])
    with torch.no_grad():
        before = float(batch_loss(gpt2, model, c))
    for _ in range(STEPS):
        batch_loss(gpt2, model, c).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return before, float(batch_loss(gpt2, model, c))


@pytest.mark.parametrize("layout", list(GPT2_LAYOUTS))
def test_tied_gpt2_gradients_match_its_own_forward(gpt2, runs, layout):
    assert gpt2.family == "hf-gpt2" and gpt2.n_layers == 6
    assert [p.names for p in gpt2.shared] == [(TIED, "lm_head.weight")]
    got = gathered(runs[layout], "grads")
    want = reference_grads(gpt2, candidate(gpt2, **GPT2_LAYOUTS[layout]))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", [name for name in GPT2_LAYOUTS if name != "dp2"])
def test_tied_gpt2_loss_after_8_steps_equals_data_parallel(gpt2, runs, trained_reference, layout):
    """After 8 AdamW steps every pipelined layout's loss (the model's own forward with the parameters gathered from
    the ranks; a tied weight's copies on two ranks must be equal) equals the data-parallel layout's within 1e-4
    relative, and so do the losses the pipeline reported before each step."""
    before, after = trained_reference
    assert after < before - 0.05  # the steps trained: an update that misses the tied weight's gradient shows
    dp_loss = loss_of(gpt2, gathered(runs["dp2"], "params"))
    assert dp_loss == pytest.approx(after, rel=1e-4)
    assert loss_of(gpt2, gathered(runs[layout], "params")) == pytest.approx(dp_loss, rel=1e-4)
    assert step_losses(runs[layout]) == pytest.approx(step_losses(runs["dp2"]), rel=1e-4)
    assert len(step_losses(runs[layout])) == STEPS


@pytest.mark.parametrize("layout", ["pp2xdp2-shard-VHalf", "pp2xdp2-shard-Interleaved1F1B"])
def test_our_orders_and_torchs_multi_stage_schedules_drive_fsdp(runs, layout):
    """torch's runtime lowers a multi-stage order (VHalf's from autotune.schedules through compat.runtime_schedule,
    and torch's own Interleaved1F1B) with FSDP actions: each stage is unsharded before its compute, resharded after,
    and its gradients reduced once."""
    for result in runs[layout]:
        kinds = [action.split(":")[1] for action in result["actions"]]
        for stage in (action.split(":")[0] for action in result["actions"] if action.endswith(":FORWARD")):
            assert f"{stage}:UNSHARD" in result["actions"] and f"{stage}:RESHARD" in result["actions"]
            assert result["actions"].count(f"{stage}:REDUCE_GRAD") == 1
        assert kinds.count("UNSHARD") >= 2


def test_the_tied_weight_is_one_optimizer_entry_when_both_uses_share_a_rank(runs):
    """ZBV puts stage 0 (wte) and stage 3 (lm_head) on rank 0: the Parameter enters its optimizer once."""
    rank0, rank1 = runs["ZBVZeroBubble"]
    assert rank0["optimizer"].count(TIED) == 1
    assert len(rank0["optimizer"]) == len(set(rank0["optimizer"])) == len(rank0["params"])
    assert TIED not in rank1["optimizer"]
    assert "?" not in rank0["optimizer"] + rank1["optimizer"]


def test_llama_with_padded_sequences_gets_its_own_gradients(llama, runs):
    """recipes/hf_llama.py's batch right-pads every other sequence (attention_mask 0, targets -100): every stage
    gets the mask, and gradients equal the model's own forward under 1F1B with an uneven split."""
    inputs, _ = make_batch(llama, 8)
    assert isinstance(inputs, dict) and (inputs["attention_mask"] == 0).any()
    assert llama.family == "hf-decoder" and llama.n_layers == 6
    got = gathered(runs["llama"], "grads")
    want = reference_grads(llama, LLAMA_1F1B)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_bert_with_its_tied_mlm_decoder_across_ranks_gets_its_own_gradients(bert, runs):
    """recipes/hf_bert.py (masked-language modelling, some sequences padded) under 1F1B: every stage gets the
    attention mask, the tied word embedding's gradient is summed over the two ranks holding it, and every gradient
    equals the model's own forward's."""
    assert bert.family == "hf-encoder" and bert.n_layers == 6
    assert [p.names for p in bert.shared] == [("bert.embeddings.word_embeddings.weight",
                                                "cls.predictions.decoder.weight")]
    got = gathered(runs["bert"], "grads")
    want = reference_grads(bert, BERT_1F1B)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_each_rank_builds_and_loads_only_its_own_stages(gpt2, tmp_path, mode):
    """build_pipeline with load_state (what setup_pipeline passes): each rank asks for exactly the state_dict names
    of its stages (the tied weight under its first name, on both ranks holding it), gets those values, and holds
    no other parameter with storage. Sharded (pp 2 x dp 2), the same names and values, and each rank stores only its
    shard of every parameter (FSDP2's DTensors, half of each over 2 replicas)."""
    from tests.dist import grad_worker

    reference = build_blocks(gpt2).model
    state = {name: torch.randn_like(t) if t.is_floating_point() else t
             for name, t in reference.state_dict().items()}
    torch.save(state, tmp_path / "state.pt")
    dp = 2 if mode == "shard" else 1  # embedding on rank 0, head on rank 1: the tied weight on both
    c = candidate(gpt2, Schedule.ONE_F_ONE_B, dp=dp, m=4 // dp, data_parallel_mode=mode)
    codes = spawn_ranks(
        grad_worker.run_loaded,
        lambda rank: (rank, c.world_size, str(gpt2.path), c.to_dict(), str(tmp_path / "state.pt"), str(tmp_path)),
        c.world_size, timeout=120,
    )
    assert codes == [0] * c.world_size
    ranks = [torch.load(tmp_path / f"loaded-{rank}.pt") for rank in range(c.world_size)]
    for result in ranks:
        assert result["real_elsewhere"] == 0
        assert TIED in result["asked"] and "lm_head.weight" not in result["asked"]
        assert set(result["params"]) <= set(result["asked"])
        for name, value in result["params"].items():
            torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)
        stored, whole = result["stored_numel"], sum(state[name].numel() for name in result["params"])
        assert stored == whole if mode == "replicate" else whole // 2 <= stored < whole // 2 + 1000
    held = [set(result["params"]) for result in ranks[:2]]
    assert held[0] & held[1] == {TIED}
    assert held[0] | held[1] == {name for name, _ in reference.named_parameters()}
