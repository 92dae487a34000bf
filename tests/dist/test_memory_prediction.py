"""The simulator's peak memory against real 2-rank CPU trials (the tracker counts live tensor bytes exactly): every
rank within 2 %, for a schedule of each kind of memory behaviour: GPipe (all micro-batches held), 1F1B (sends waited
one by one), Interleaved 1F1B (several stages per rank, every send kept to the end of the pipeline) and ZBV (split
backward: an I keeps gradients for its W), on an MLP and a small GPT (issue 24: each rank's peak accounted, by
kind, against the model's terms with bench/memory_breakdown.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.candidate import Candidate
from autotune.costs import Profile
from autotune.model_file import load_model_file
from autotune.profiling import profile_model
from autotune.schedules import Schedule
from autotune.simulate import simulate
from autotune.trial import TrialOptions, run_trial

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    ("recipes/mlp.py", 64, Schedule.GPIPE, 4, (5, 5)),
    ("recipes/mlp.py", 64, Schedule.ONE_F_ONE_B, 4, (3, 7)),
    ("recipes/gpt.py", 32, Schedule.INTERLEAVED_1F1B, 4, (2, 2, 2, 2)),
    ("recipes/gpt.py", 32, Schedule.ZBV_ZERO_BUBBLE, 4, (1, 2, 2, 3)),
]


@pytest.fixture(scope="module")
def peaks() -> dict[Schedule, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per case: (predicted, measured) peak bytes per rank."""
    profiles: dict[tuple[str, int], Profile] = {}
    result = {}
    for model, batch, schedule, m, split in CASES:
        spec = load_model_file(ROOT / model)
        if (model, batch) not in profiles:
            profiles[(model, batch)] = profile_model(spec, batch_size=batch, repeats=1)
        candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=batch, n_microbatches=m,
                              layers_per_stage=split)
        measured = run_trial(spec, candidate, TrialOptions(steps=1, warmup=2, device="cpu"))
        assert measured.status == "ok", measured.error
        predicted = simulate(profiles[(model, batch)], candidate, with_timeline=False).peak_memory_bytes
        result[schedule] = (predicted, measured.peak_memory_bytes)
    return result


@pytest.mark.dist
@pytest.mark.parametrize("schedule", [c[2] for c in CASES])
def test_every_rank_within_2_percent(peaks, schedule):
    predicted, measured = peaks[schedule]
    assert all(abs(p - got) <= 0.02 * got for p, got in zip(predicted, measured)), (predicted, measured)


@pytest.fixture(scope="module")
def bf16_peaks(tmp_path_factory) -> dict[Schedule, tuple[tuple[int, ...], tuple[int, ...]]]:
    """bf16 on recipes/gpt.py with a 16x vocabulary, where the logits outweigh the blocks: per schedule, (predicted,
    measured) peak bytes per rank."""
    path = tmp_path_factory.mktemp("logits") / "gpt_logits.py"
    path.write_text((ROOT / "recipes" / "gpt.py").read_text().replace("VOCAB = 512", "VOCAB = 8192", 1))
    spec = load_model_file(path)
    profile = profile_model(spec, batch_size=16, repeats=1, precision="bf16")
    result = {}
    for schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=16, n_microbatches=2,
                              layers_per_stage=(4, 4), precision="bf16")
        measured = run_trial(spec, candidate, TrialOptions(steps=1, warmup=2, device="cpu"))
        assert measured.status == "ok", measured.error
        predicted = simulate(profile, candidate, with_timeline=False).peak_memory_bytes
        result[schedule] = (predicted, measured.peak_memory_bytes)
    return result


@pytest.mark.dist
@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
def test_bf16_last_stage_within_2_percent_with_the_loss_in_float32(bf16_peaks, schedule):
    """The last stage keeps its output as the loss gets it, float32, and the loss's backward makes float32 gradients
    (predicted as twice the bfloat16 logits before: the last rank 24-34 % under, an H200's 170 M GPT 13.5 %)."""
    predicted, measured = bf16_peaks[schedule]
    assert all(abs(p - got) <= 0.02 * got for p, got in zip(predicted, measured)), (predicted, measured)


TIED_MODEL = '''
import torch
from torch import nn

VOCAB, WIDTH, SEQ = 4096, 32, 16


class Head(nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB, bias=False)
        self.proj.weight = embedding.weight  # tied, as language models tie their head to the token embedding

    def forward(self, x):
        return self.proj(x)


def build_model():
    embedding = nn.Embedding(VOCAB, WIDTH)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(4)]
    return nn.Sequential(embedding, *blocks, Head(embedding))


def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
'''


@pytest.mark.dist
@pytest.mark.parametrize("schedule, split", [(Schedule.ONE_F_ONE_B, (3, 3)), (Schedule.V_HALF, (1, 2, 2, 1))])
def test_tied_weights_within_2_percent(tmp_path, schedule, split):
    """A token embedding tied to the head: AdamW's per-tensor temporaries on CPU are those of the one tied tensor,
    on each rank that holds it, and the profile's peak counts it once (the copy on the last stage made the first
    rank's step 20 % over on a Hugging Face OPT with a 16 k vocabulary, and the last rank's far under). Under V
    placement the first rank holds the embedding and the head: one Parameter (it was counted twice: +33-64 %)."""
    path = tmp_path / "tied.py"
    path.write_text(TIED_MODEL)
    spec = load_model_file(path)
    profile = profile_model(spec, batch_size=8, repeats=1)
    assert profile.shared_parameters
    candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=8, n_microbatches=2,
                          layers_per_stage=split)
    measured = run_trial(spec, candidate, TrialOptions(steps=1, warmup=2, device="cpu"))
    assert measured.status == "ok", measured.error
    predicted = simulate(profile, candidate, with_timeline=False).peak_memory_bytes
    got = measured.peak_memory_bytes
    # 8 KiB of slack for the tiny second rank (~200 KB): torch 2.11 makes 4 KB more there than 2.14 does
    assert all(abs(p - g) <= max(0.02 * g, 8192) for p, g in zip(predicted, got)), (predicted, got)


@pytest.mark.dist
@pytest.mark.parametrize("schedule, split", [(Schedule.ZBV_ZERO_BUBBLE, (2, 2, 2, 2)),
                                             (Schedule.DUAL_PIPE_V, (4, 1, 2, 1))])
def test_a_checkpointed_split_backward_is_not_under_predicted(schedule, split):
    """torch's W of a checkpointed stage recomputes it once per parameter group and keeps most of each recompute
    until a pass walks what saved it or no group left reaches it: recipes/gpt.py's ranks were 26-56 % under before
    that was modelled, then over by up to 43 % (every pass's keeps counted for the whole W); composed pass by pass
    from each block measured alone (simulate._composed_weight_recompute_bytes): +0.0 .. +2.0 %."""
    spec = load_model_file(ROOT / "recipes" / "gpt.py")
    profile = profile_model(spec, batch_size=32, repeats=1)
    candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=32, n_microbatches=4,
                          layers_per_stage=split, activation_checkpointing=True)
    measured = run_trial(spec, candidate, TrialOptions(steps=1, warmup=2, device="cpu"))
    assert measured.status == "ok", measured.error
    predicted = simulate(profile, candidate, with_timeline=False).peak_memory_bytes
    got = measured.peak_memory_bytes
    assert all(0.98 * g <= p <= 1.05 * g for p, g in zip(predicted, got)), (predicted, got)


BF16_WIRE_CASES = [
    # a GPT's residual stream is float32 under autocast and crosses as bfloat16: receive buffers and kept outputs
    # were counted at float32 (+13 %)
    ("recipes/gpt.py", Schedule.INTERLEAVED_1F1B, 8, (1, 3, 3, 1)),
    # a CNN's blocks end in bfloat16: the runtime casts what arrives to float32 (a copy in the forward, a float32
    # gradient in the backward: rank 1 was -15 %), and the output leaves as it is (its saved copy counted twice)
    ("recipes/cnn.py", Schedule.V_MIN, 1, (2, 2, 1, 3)),
    ("recipes/cnn.py", Schedule.GPIPE, 2, (3, 5)),
]


@pytest.mark.dist
@pytest.mark.parametrize("model, schedule, m, split", BF16_WIRE_CASES)
def test_bf16_tensors_between_stages_within_2_percent(model, schedule, m, split):
    spec = load_model_file(ROOT / model)
    profile = profile_model(spec, batch_size=64, repeats=1, precision="bf16")
    candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=64, n_microbatches=m,
                          layers_per_stage=split, precision="bf16")
    measured = run_trial(spec, candidate, TrialOptions(steps=1, warmup=2, device="cpu"))
    assert measured.status == "ok", measured.error
    predicted = simulate(profile, candidate, with_timeline=False).peak_memory_bytes
    got = measured.peak_memory_bytes
    assert all(abs(p - g) <= 0.02 * g for p, g in zip(predicted, got)), (predicted, got)
