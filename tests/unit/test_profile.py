import dataclasses
import json
import math

import pytest
import torch

from autotune.costs import LayerCost, LayerProfile, Profile
from autotune.errors import UsageError
from autotune.model_file import load_model_file
from autotune.profiling import default_micro_batch_sizes, profile_model
from tests.conftest import RECIPES


@pytest.fixture(scope="module")
def mlp_profile():
    spec = load_model_file(RECIPES / "mlp.py")
    calls = []
    threads = torch.get_num_threads()
    profile = profile_model(spec, batch_size=8, micro_batch_sizes=[8, 2], repeats=2,
                            progress=lambda done, total, what: calls.append((done, total, what)))
    return spec, profile, calls, threads


def test_profile_of_the_mlp_recipe(mlp_profile):
    spec, profile, calls, threads = mlp_profile
    assert profile.micro_batch_sizes == (2, 8)  # sorted
    assert profile.n_layers == spec.n_layers == 10
    assert [layer.name for layer in profile.layers] == list(spec.layer_names)
    assert [layer.parameter_bytes for layer in profile.layers] == list(spec.parameter_bytes)
    assert [(done, total) for done, total, _ in calls] == [(i, 10) for i in range(1, 11)]
    # blocks 6, 7 and 8 are the same Linear(64, 64) + GELU: all three measured in place (IN_PLACE_COPIES)
    assert [what.endswith("(as an earlier one)") for _, _, what in calls] == [False] * 10
    assert torch.get_num_threads() == threads  # restored
    for layer in profile.layers:
        assert all(t > 0 for t in layer.forward_ms)
        assert all(t >= 0 for t in layer.backward_input_ms + layer.backward_weight_ms)
        assert all(t > 0 for t in (i + w for i, w in zip(layer.backward_input_ms, layer.backward_weight_ms)))
        small, large = layer.saved_bytes
        assert 0 < small < large  # saved activations grow with the micro-batch
        assert layer.output_bytes[1] == 4 * layer.output_bytes[0]  # 8 samples vs 2
    assert profile.input_bytes[1] == 4 * profile.input_bytes[0] > 0
    assert profile.optimizer_step_ms > 0
    # a step over one element: what every one of the 10 per-block steps paid on top of its bytes
    assert 0 < profile.optimizer_call_ms < profile.optimizer_step_ms
    assert 0 < profile.host_call_ms < 1.0  # the host's probe: a plain AdamW step over one element, tens of us
    # the idle probe: its workload's time back to back, and what each rising gap before it added (>= 0)
    gaps = [g for g, _ in profile.idle_resume_ms]
    assert gaps == sorted(gaps) and len(gaps) >= 3 and all(ms >= 0 for _, ms in profile.idle_resume_ms)
    assert 0 < profile.idle_resume_window_ms < 100
    assert profile.optimizer_state_bytes == pytest.approx(2 * profile.parameter_bytes, rel=0.01)  # AdamW
    assert 0 < profile.optimizer_peak_bytes <= 3 * profile.parameter_bytes  # foreach temporaries
    assert profile.loss_forward_ms[0] > 0 and profile.loss_backward_ms[0] > 0
    assert [layer.parameter_groups for layer in profile.layers] == [1] * 10  # one Linear each
    # each later block's checkpointed W pass by pass: one pass (one group), the same as a stage's last block and an
    # earlier one, its peaks those of the whole W (the first block's W is a whole backward: nothing measured)
    assert profile.layers[0].checkpoint_passes == ()
    for layer in profile.layers[1:]:
        assert len(layer.checkpoint_passes) == 2  # per size
        for passes, whole in zip(layer.checkpoint_passes, layer.checkpoint_weight_bytes or (0, 0)):
            assert len(passes.free) == len(passes.held) == 1
            recomputing, walking, _ = passes.free[0]
            assert max(recomputing, walking) == whole
    # Checkpointing measured, not assumed: a forward again (with bookkeeping) in the backward, per size.
    assert len(profile.checkpoint_forward_ratio) == len(profile.checkpoint_recompute_ratio) == 2
    # (ratios of two timings, each block checkpointed on its own: on a loaded machine they wander far from 1, so
    # only that they were measured is checked here)
    for r in (*profile.checkpoint_forward_ratio, *profile.checkpoint_recompute_ratio):
        assert 0 < r < math.inf and r != 1.0


def test_checkpointed_costs_follow_the_measured_ratios():
    layer = LayerProfile(name="x", parameter_bytes=0, forward_ms=(2.0,), backward_input_ms=(1.0,),
                         backward_weight_ms=(1.0,), saved_bytes=(10,), output_bytes=(10,))
    profile = Profile(micro_batch_sizes=(4,), layers=(layer, layer), input_bytes=(10,), loss_forward_ms=(0.5,),
                      checkpoint_forward_ratio=(1.25,), checkpoint_recompute_ratio=(1.5,))
    first, last = profile.layer_costs(4)
    assert (first.checkpointed_forward_ms, first.recompute_ms) == (2.5, 3.0)
    assert (last.checkpointed_forward_ms, last.recompute_ms) == (2.5 + 0.5, 3.0)  # the loss is not checkpointed
    older = Profile(micro_batch_sizes=(4,), layers=(layer,), input_bytes=(10,))  # measured before the ratios
    assert (older.layer_costs(4)[0].checkpointed_forward_ms, older.layer_costs(4)[0].recompute_ms) == (2.0, 2.0)


def test_saved_and_output_bytes_are_exact(model_file):
    # Linear(8,16) -> Tanh -> Linear(16,16) -> Last(Linear(16,4)), float32
    profile = profile_model(load_model_file(model_file()), batch_size=4, micro_batch_sizes=[4], repeats=1)
    m = 4
    assert [layer.output_bytes for layer in profile.layers] == [(m * 16 * 4,), (m * 16 * 4,), (m * 16 * 4,),
                                                                 (m * 4 * 4,)]
    # Linear keeps its input (not its weight); Tanh keeps its output, which the next Linear also keeps (one
    # storage, counted once, for Tanh); Last keeps its input.
    assert [layer.saved_bytes for layer in profile.layers] == [(m * 8 * 4,), (m * 16 * 4,), (0,), (m * 16 * 4,)]
    # Of them, the layer's input (what a stage starting there saves of its receive buffer) and its output (what a
    # stage ending there saves of the output it sends).
    assert [layer.saved_input_bytes for layer in profile.layers] == [(m * 8 * 4,), (0,), (0,), (m * 16 * 4,)]
    assert [layer.saved_output_bytes for layer in profile.layers] == [(0,), (m * 16 * 4,), (0,), (0,)]
    assert profile.input_bytes == (m * 8 * 4,)
    assert profile.target_bytes == (m * 4 * 4,)
    assert [layer.parameter_bytes for layer in profile.layers] == [(8 * 16 + 16) * 4, 0, (16 * 16 + 16) * 4,
                                                                    (16 * 4 + 4) * 4]
    # on a bfloat16 wire (fp32 with --wire-dtype bfloat16) every output travels at half its bytes
    assert [layer.wire_output_bytes for layer in profile.layers] == [(m * 16 * 2,), (m * 16 * 2,), (m * 16 * 2,),
                                                                      (m * 4 * 2,)]


def test_backward_bytes_are_what_each_backward_holds(model_file):
    """Linear(16, 16) of the same model, micro-batch 4 (gradient of its input: 4 x 16 x 4 B = 256; of its weight
    and bias: 1088): a whole backward holds both at once, and with its output's gradient made inside (by a product,
    as a later layer or the loss makes it) that gradient too, 256, and the product's few bytes of scalars; torch's
    split backward's I makes the input's gradient only, and keeps the output's gradient for its W where it was made
    inside (the weight op reads it), nothing where it was handed in."""
    profile = profile_model(load_model_file(model_file()), batch_size=4, micro_batch_sizes=[4], repeats=1)
    (linear,) = profile.layers[2].backward_bytes
    grads, into, out = 1088, 256, 256
    for made, handed in (linear.first, linear.later):
        assert handed == grads + into
        assert made == pytest.approx(grads + into + out, abs=16)
    assert linear.input_peak[1] == into and linear.input_peak[0] == pytest.approx(into + out, abs=16)
    assert linear.input_kept[1] == 0 and linear.input_kept[0] == pytest.approx(out, abs=16)
    (first,) = profile.layers[0].backward_bytes  # its input is the batch: no input gradient, so the I does nothing
    assert first.later[1] == (8 * 16 + 16) * 4 and first.input_peak[1] == first.input_kept[1] == 0
    assert profile.layer_costs(4)[2].backward_bytes == linear
    assert profile.layer_costs(8)[2].backward_bytes.later[1] == 2 * (grads + into)  # one size: in proportion


def test_profile_round_trips_through_json(mlp_profile):
    profile = mlp_profile[1]
    again = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile
    with pytest.raises(UsageError, match="profile version 9 is not supported"):
        Profile.from_dict({**profile.to_dict(), "version": 9})
    with pytest.raises(UsageError, match="cannot read profile"):
        Profile.from_dict({"micro_batch_sizes": [1]})


def test_token_ids_work_and_the_embedding_has_no_input_grad():
    spec = load_model_file(RECIPES / "gpt.py")
    profile = profile_model(spec, batch_size=2, micro_batch_sizes=[2], repeats=1)
    embedding = profile.layers[0]
    assert embedding.name == "Embedding"
    assert embedding.backward_input_ms == (0.0,)
    assert embedding.backward_weight_ms[0] > 0
    assert all(layer.backward_input_ms[0] > 0 for layer in profile.layers[1:])
    # Parameter groups (modules with parameters of their own): token + position embeddings; a block's two norms,
    # attention (in-projection) and its out-projection, two MLP linears; the head's norm and linear.
    assert [layer.parameter_groups for layer in profile.layers] == [2] + [6] * 6 + [2]


def test_profile_refuses_bad_arguments():
    spec = load_model_file(RECIPES / "mlp.py")
    with pytest.raises(UsageError, match="at least 1"):
        profile_model(spec, batch_size=8, micro_batch_sizes=[0, 2])
    with pytest.raises(UsageError, match="repeats"):
        profile_model(spec, batch_size=8, repeats=0)


@pytest.mark.parametrize(
    "batch, expected",
    [(1, [1]), (3, [1, 3]), (12, [1, 2, 4, 12]), (64, [1, 2, 4, 16, 32, 64]), (96, [1, 2, 4, 16, 32, 96]),
     (1024, [1, 4, 16, 64, 256, 1024])],
)
def test_default_micro_batch_sizes(batch, expected):
    assert default_micro_batch_sizes(batch) == expected


def affine_profile():
    """Two profiled sizes, cost = 1 + M ms: a fixed 1 ms per micro-batch plus 1 ms per sample."""
    sizes = (2, 4)
    layer = LayerProfile(name="L", parameter_bytes=40, forward_ms=(3.0, 5.0), backward_input_ms=(3.0, 5.0),
                         backward_weight_ms=(1.0, 1.0), saved_bytes=(200, 400), output_bytes=(20, 40))
    return Profile(micro_batch_sizes=sizes, layers=(layer, layer), input_bytes=(8, 16),
                   loss_forward_ms=(0.5, 0.5), loss_backward_ms=(0.25, 0.25), loss_saved_bytes=(2, 4))


@pytest.mark.parametrize("m, forward", [(2, 3.0), (3, 4.0), (4, 5.0), (8, 9.0), (1, 2.0)])
def test_layer_costs_interpolate_and_keep_the_fixed_cost(m, forward):
    costs = affine_profile().layer_costs(m)
    assert costs[0].forward_ms == pytest.approx(forward)  # at M = 1 the intercept survives: 2, not 1.5
    assert costs[0].backward_weight_ms == pytest.approx(1.0)
    assert costs[0].saved_bytes == 100 * m
    assert costs[0].parameter_bytes == 40


def test_layer_costs_charge_the_loss_to_the_last_layer():
    first, last = affine_profile().layer_costs(4)
    assert last.forward_ms == pytest.approx(first.forward_ms + 0.5)
    assert last.backward_input_ms == pytest.approx(first.backward_input_ms + 0.25)
    assert last.saved_bytes == first.saved_bytes + 4
    assert last.backward_ms == pytest.approx(last.backward_input_ms + last.backward_weight_ms)


def test_noise_never_makes_a_cost_negative_or_shrink_past_the_measurements():
    sizes = (1, 2)
    noisy = LayerProfile(name="L", parameter_bytes=0, forward_ms=(1.0, 0.9), backward_input_ms=(1.0, 3.0),
                         backward_weight_ms=(0.0, 0.0), saved_bytes=(10, 20), output_bytes=(1, 2))
    profile = Profile(micro_batch_sizes=sizes, layers=(noisy,), input_bytes=(1, 2))
    assert profile.layer_costs(16)[0].forward_ms == pytest.approx(0.9)  # not extrapolated below the last point
    single = Profile.from_layer_costs([LayerCost(forward_ms=2.0, backward_input_ms=1.0, backward_weight_ms=1.0,
                                                 saved_bytes=10, output_bytes=4, parameter_bytes=0)],
                                      micro_batch_size=4)
    assert single.layer_costs(2)[0].forward_ms == pytest.approx(1.0)  # one size: proportional
    with pytest.raises(UsageError, match="positive"):
        single.layer_costs(0)


def test_profile_checks_its_series():
    layer = LayerProfile(name="L", parameter_bytes=0, forward_ms=(1.0,), backward_input_ms=(1.0,),
                         backward_weight_ms=(1.0,), saved_bytes=(1,), output_bytes=(1,))
    with pytest.raises(UsageError, match="2 entries"):
        Profile(micro_batch_sizes=(1, 2), layers=(layer,), input_bytes=(1, 2))
    with pytest.raises(UsageError, match="increasing"):
        Profile(micro_batch_sizes=(2, 1), layers=(layer,), input_bytes=(1, 2))


def test_batchnorm_models_skip_micro_batch_one_and_a_size_too_small_is_left_out(tmp_path):
    """Asked for size 1 (plan and search ask for the sizes their candidates use), a BatchNorm1d block fails to train
    on one sample: the size is left out of the profile and of every plan, as a size out of memory is, where a
    larger one trains; alone, the failure is named in one line."""
    from autotune.errors import ModelFileError
    from autotune.model_file import load_model_file
    from autotune.plan import plan
    from autotune.profiling import profile_model
    from tests.fakes import BATCHNORM_MODEL

    path = tmp_path / "bn.py"
    path.write_text(BATCHNORM_MODEL)
    spec = load_model_file(path)
    assert profile_model(spec, batch_size=8, repeats=1).micro_batch_sizes[0] == 2
    profile = profile_model(spec, batch_size=8, micro_batch_sizes=[1, 2, 4], repeats=1)
    assert profile.micro_batch_sizes == (2, 4) and profile.too_small_micro_batch_sizes == (1,)
    assert not profile.fits_micro_batch(1) and profile.fits_micro_batch(2)
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))).too_small_micro_batch_sizes == (1,)
    planned = plan(profile, gpus=2, batch_size=8, memory_limit_bytes=None)
    assert planned and all(p.candidate.micro_batch_size >= 2 for p in planned)
    assert any(p.candidate.micro_batch_size == 2 for p in planned)
    with pytest.raises(ModelFileError, match=r"micro-batch size 1 \(ValueError: Expected more than 1 value"):
        profile_model(spec, batch_size=8, micro_batch_sizes=[1], repeats=1)


PICKY = """
import torch
from torch import nn

class Picky(nn.Linear):
    def forward(self, x):
        if x.shape[0] < SMALLEST:
            raise RuntimeError(f"needs {SMALLEST} rows, got {x.shape[0]}")
        return super().forward(x)

def build_model():
    return nn.Sequential(nn.Linear(8, 8), Picky(8, 8), nn.Linear(8, 2))

def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 2)

def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)
"""


def test_sizes_too_small_for_a_later_block_are_left_out_and_a_block_failing_at_every_size_is_named(tmp_path):
    from autotune.errors import ModelFileError
    from autotune.model_file import load_model_file
    from autotune.profiling import profile_model

    (tmp_path / "picky.py").write_text(PICKY.replace("SMALLEST", "4"))
    spec = load_model_file(tmp_path / "picky.py")
    profile = profile_model(spec, batch_size=16, micro_batch_sizes=[1, 2, 4, 16], repeats=1)
    assert profile.micro_batch_sizes == (4, 16) and profile.too_small_micro_batch_sizes == (1, 2)
    assert profile.n_layers == 3 and all(layer.forward_ms[0] > 0 for layer in profile.layers)
    (tmp_path / "never.py").write_text(PICKY.replace("SMALLEST", "100"))
    spec = load_model_file(tmp_path / "never.py")
    with pytest.raises(ModelFileError, match=r"block 1 .*failed at every micro-batch size tried \(1, 2, 4\), first at "
                                             r"1 \(RuntimeError: needs 100 rows, got 1\)"):
        profile_model(spec, batch_size=16, micro_batch_sizes=[1, 2, 4], repeats=1)


def _measured_blocks(monkeypatch):
    """The blocks profile_model materialises, one per block it measures (the last index named: the others are the
    window's, already real)."""
    import autotune.profiling

    measured: list[int] = []
    real = autotune.profiling.materialize

    def spy(model, blocks, names, indices, **kwargs):
        measured.append(list(indices)[-1])
        return real(model, blocks, names, indices, **kwargs)

    monkeypatch.setattr(autotune.profiling, "materialize", spy)
    return measured


def test_blocks_that_are_the_same_are_measured_once_unless_every_block_is_asked(monkeypatch):
    import autotune.profiling

    monkeypatch.setattr(autotune.profiling, "IN_PLACE_COPIES", 2)
    spec = load_model_file(RECIPES / "mlp.py")  # blocks 6, 7, 8: Linear(64, 64) + GELU
    measured = _measured_blocks(monkeypatch)
    profile = profile_model(spec, batch_size=4, micro_batch_sizes=[4], repeats=1)
    assert measured == [0, 1, 2, 3, 4, 5, 6, 7, 9]  # two of the same in place (IN_PLACE_COPIES), the third copied
    assert profile.layers[8] == profile.layers[7]
    assert profile.layers[6].saved_bytes == profile.layers[7].saved_bytes
    assert profile.loss_forward_ms[0] > 0
    assert profile.layers[5] != profile.layers[6]
    measured.clear()
    every = profile_model(spec, batch_size=4, micro_batch_sizes=[4], repeats=1, every_block=True)
    assert measured == list(range(10))
    assert [layer.saved_bytes for layer in every.layers] == [layer.saved_bytes for layer in profile.layers]


def _timed_chains(monkeypatch) -> list[list[int]]:
    """The blocks of every timed pass, in order (each a list of block indices)."""
    import autotune.profiling

    chains: list[list[int]] = []
    index: dict[int, int] = {}
    real_pass, real_open = autotune.profiling._chain_pass, autotune.profiling._Walk._open

    def chain_pass(units, *args, **kwargs):
        chains.append([index[id(unit.block)] for unit in units])
        return real_pass(units, *args, **kwargs)

    def open_block(self, i, *args, **kwargs):
        index[id(self.skeleton.blocks[i])] = i
        return real_open(self, i, *args, **kwargs)

    monkeypatch.setattr(autotune.profiling, "_chain_pass", chain_pass)
    monkeypatch.setattr(autotune.profiling._Walk, "_open", open_block)
    return chains


def test_consecutive_blocks_are_timed_in_one_pass_within_the_window(monkeypatch):
    """Issue 29: a block timed alone, over and over, ran 13-29 % faster than inside a pass of the model (warm caches);
    blocks are timed in place, in passes through as many measured blocks as the window holds; a twin taking another's
    figures is left out of the pass (not materialised) and the block after it follows the one before."""
    import autotune.profiling

    monkeypatch.setattr(autotune.profiling, "IN_PLACE_COPIES", 2)
    spec = load_model_file(RECIPES / "mlp.py")  # blocks 6, 7, 8: the same; 8 takes 7's figures
    chains = _timed_chains(monkeypatch)
    profile_model(spec, batch_size=4, micro_batch_sizes=[4], repeats=1)
    # each block's own passes (one for the optimizer's gradients, two warm-ups), then the passes through the window
    assert {tuple(c) for c in chains} == {(0, 1, 2, 3, 4, 5, 6, 7, 9), *((i,) for i in [*range(8), 9])}
    assert chains.count([0, 1, 2, 3, 4, 5, 6, 7, 9]) == 3  # one round: untimed, full, input-grad
    chains.clear()
    # At most WINDOW_PARAMETER_BYTES of parameters together: a model larger than the device is still measured a
    # block at a time.
    budget = spec.parameter_bytes[2] + spec.parameter_bytes[3]  # blocks 1-3: 128 K, 1 M, 512 K parameters
    monkeypatch.setattr(autotune.profiling, "WINDOW_PARAMETER_BYTES", budget)
    profile_model(spec, batch_size=4, micro_batch_sizes=[4], repeats=1)
    windows = [c for i, c in enumerate(chains) if len(c) > 1 and c not in chains[:i]]
    assert windows == [[0, 1], [2, 3], [4, 5, 6, 7, 9]]


def test_sliding_window_and_full_attention_layers_are_measured_apart(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    (tmp_path / "qwen.py").write_text(QWEN_SLIDING)
    import autotune.profiling

    monkeypatch.setattr(autotune.profiling, "IN_PLACE_COPIES", 2)
    spec = load_model_file(tmp_path / "qwen.py")  # layers 0-2 full attention, 3-5 a sliding window of 4
    measured = _measured_blocks(monkeypatch)
    profile_model(spec, batch_size=2, micro_batch_sizes=[2], repeats=1)
    # embedding, two full-attention layers (IN_PLACE_COPIES), two sliding-window ones, the head
    assert measured == [0, 1, 2, 4, 5, 7]


def _live_storage_bytes() -> int:
    import gc

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_after_profiling_the_process_holds_no_model(tmp_path):
    """Issue 30, item 1: the tuner goes on to plan and launch trials; it must not keep the model it profiled."""
    (tmp_path / "wide.py").write_text(WIDE)
    spec = load_model_file(tmp_path / "wide.py")
    before = _live_storage_bytes()
    profile = profile_model(spec, batch_size=4, micro_batch_sizes=[2, 4], repeats=1)
    assert profile.parameter_bytes == 6 * (512 * 512 + 512) * 4  # 6.3 MB of parameters, as much in gradients
    assert _live_storage_bytes() - before < 64 * 1024


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_after_profiling_no_graph_of_a_block_that_saves_its_output_survives(precision):
    """The saved-bytes pass's graph must go with the profile: a block saving its own output (log-softmax in the
    loss, a clone in attention) tied it in a cycle through C++ that Python's collector cannot free (seen on an H200:
    3.7 GB of a GPT's graph stayed allocated in the tuner after profiling)."""
    spec = load_model_file(RECIPES / "gpt.py")
    before = _live_storage_bytes()
    profile_model(spec, batch_size=8, micro_batch_sizes=[4, 8], repeats=1, precision=precision)
    assert _live_storage_bytes() - before < 64 * 1024


def test_the_last_block_is_measured_with_the_loss_even_when_it_is_like_the_others(tmp_path, monkeypatch):
    import autotune.profiling

    monkeypatch.setattr(autotune.profiling, "IN_PLACE_COPIES", 2)
    (tmp_path / "wide.py").write_text(WIDE)  # six Linear(512, 512)
    measured = _measured_blocks(monkeypatch)
    profile = profile_model(load_model_file(tmp_path / "wide.py"), batch_size=2, micro_batch_sizes=[2], repeats=1)
    # the first takes the model's input (no input gradient), two more in place, the last the loss
    assert measured == [0, 1, 2, 5]
    assert profile.loss_forward_ms[0] > 0 and profile.loss_backward_ms[0] > 0
    assert profile.layers[2] == profile.layers[3] == profile.layers[4] != profile.layers[0]


def test_a_micro_batch_size_out_of_memory_is_recorded_and_planned_around(tmp_path):
    from autotune.errors import InfeasibleError
    from autotune.plan import plan
    from autotune.trial.memory import LiveTensorBytes

    (tmp_path / "wide.py").write_text(WIDE)
    spec = load_model_file(tmp_path / "wide.py")
    with LiveTensorBytes() as tracker:
        baseline = tracker.live_bytes
    batches = 2 * (4 + 1024) * 512 * 4  # inputs and targets of both sizes, on the "device" while profiling
    # one block's parameters and gradients (SGD: no state; 2 MiB) and a few micro-batches of 4 fit; the
    # activations of 1024 samples (2 MiB each for input, output and their gradients) do not
    limit = baseline + batches + 2 * (512 * 512 + 512) * 4 + 2 * 2**20
    profile = profile_model(spec, batch_size=1024, micro_batch_sizes=[4, 1024], repeats=1,
                            memory_limit_bytes=limit)
    assert profile.micro_batch_sizes == (4,) and profile.infeasible_micro_batch_sizes == (1024,)
    again = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again.infeasible_micro_batch_sizes == (1024,)
    planned = plan(profile, gpus=2, batch_size=1024, memory_limit_bytes=None)
    assert planned and all(p.candidate.micro_batch_size < 1024 for p in planned)
    everything_out = dataclasses.replace(profile, infeasible_micro_batch_sizes=(1,))
    with pytest.raises(InfeasibleError, match="micro-batches of 1 or more samples, which ran out of memory"):
        plan(everything_out, gpus=2, batch_size=1024, memory_limit_bytes=None)


def test_a_block_whose_training_state_alone_is_over_the_limit_is_infeasible(tmp_path):
    from autotune.errors import InfeasibleError

    (tmp_path / "wide.py").write_text(WIDE)
    spec = load_model_file(tmp_path / "wide.py")
    with pytest.raises(InfeasibleError, match=r"block 0 \(Linear\) alone needs more memory .*--memory-limit.*"
                                              r"sharded data parallelism \(--data-parallel shard"):
        profile_model(spec, batch_size=4, micro_batch_sizes=[4], repeats=1, memory_limit_bytes=2**20)


WIDE = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])

def make_batch(batch_size):
    return torch.randn(batch_size, 512), torch.randn(batch_size, 512)

def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)

def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.01)
"""

QWEN_SLIDING = """
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

def build_model():
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_sliding_window=True, sliding_window=4,
        max_window_layers=3))

def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, 128, (batch_size, 17), generator=g)
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, 128), targets.reshape(-1))
"""


def test_bf16_profiles_under_autocast_and_counts_its_weight_copies_apart(model_file):
    """The model of test_saved_and_output_bytes_are_exact under torch.autocast(bfloat16): every tensor a Linear
    makes is bfloat16, so outputs and what is saved halve; the first Linear saves its input's bfloat16 copy; the
    others save their input and the bfloat16 copy of their weight (16 x 16 and 16 x 4 elements), which is counted
    apart (a sharded stage computes on bfloat16 parameters: nothing to cast)."""
    profile = profile_model(load_model_file(model_file()), batch_size=4, micro_batch_sizes=[4], repeats=1,
                            precision="bf16")
    m = 4
    assert profile.precision == "bf16"
    assert [layer.output_bytes for layer in profile.layers] == [(m * 16 * 2,), (m * 16 * 2,), (m * 16 * 2,),
                                                                 (m * 4 * 2,)]
    assert [layer.saved_bytes for layer in profile.layers] == [(m * 8 * 2,), (m * 16 * 2,), (0,), (m * 16 * 2,)]
    assert [layer.autocast_copy_bytes for layer in profile.layers] == [0, 0, 16 * 16 * 2, 16 * 4 * 2]
    assert [layer.parameter_bytes for layer in profile.layers] == [(8 * 16 + 16) * 4, 0, (16 * 16 + 16) * 4,
                                                                    (16 * 4 + 4) * 4]  # float32 master weights
    assert profile.layer_costs(4)[2].autocast_copy_bytes == 16 * 16 * 2
    assert [layer.wire_output_bytes for layer in profile.layers] == [layer.output_bytes for layer in profile.layers]
    again = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile


RESIDUAL = """
import torch
from torch import nn

class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.linear(x)

def build_model():
    return nn.Sequential(Residual(), Residual(), nn.Linear(16, 4))

def make_batch(batch_size):
    return torch.randn(batch_size, 16), torch.randn(batch_size, 4)

def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""


def test_a_bf16_residual_stream_is_float32_and_travels_as_bfloat16(tmp_path):
    """Under autocast a residual add keeps the stream's float32 (float32 + bfloat16, as a GPT's from its embedding):
    those outputs are made in float32, and a bfloat16 wire halves them (what receive buffers and transfers count)."""
    (tmp_path / "residual.py").write_text(RESIDUAL)
    profile = profile_model(load_model_file(tmp_path / "residual.py"), batch_size=4, micro_batch_sizes=[4],
                            repeats=1, precision="bf16")
    m = 4
    assert [layer.output_bytes for layer in profile.layers] == [(m * 16 * 4,), (m * 16 * 4,), (m * 4 * 2,)]
    assert [layer.wire_output_bytes for layer in profile.layers] == [(m * 16 * 2,), (m * 16 * 2,), (m * 4 * 2,)]
    assert profile.layer_costs(4)[1].wire_output_bytes == m * 16 * 2


def test_profiles_saved_before_precision_load_as_fp32():
    layer = LayerProfile(name="x", parameter_bytes=8, forward_ms=(2.0,), backward_input_ms=(1.0,),
                         backward_weight_ms=(1.0,), saved_bytes=(10,), output_bytes=(10,))
    saved = Profile(micro_batch_sizes=(4,), layers=(layer,), input_bytes=(10,)).to_dict()
    del saved["precision"]
    old = Profile.from_dict(saved)
    assert old.precision == "fp32" and old.layers[0].autocast_copy_bytes == 0
    with pytest.raises(UsageError, match="profile precision 'fp16' is not one of fp32, bf16"):
        Profile.from_dict({**saved, "precision": "fp16"})
    with pytest.raises(UsageError, match="precision 'fp16' is not one of fp32, bf16; pass --precision"):
        profile_model(None, batch_size=4, precision="fp16")  # type: ignore[arg-type]


def test_the_optimizer_step_is_timed_on_the_gradients_a_backward_leaves(tmp_path):
    """On zero gradients Adam's second moment stays zero and its sqrt takes a slow path on the CPU (twice a real
    step's time): the step is timed on a backward's gradients, zero only where a step leaves them zero (an
    embedding's rows no token reached)."""
    path = tmp_path / "model.py"
    path.write_text(
        "import torch\n"
        "from torch import nn\n"
        "SEEN = []\n"
        "class Recording(torch.optim.SGD):\n"
        "    def step(self, closure=None):\n"
        "        SEEN.extend((tuple(p.shape), float((p.grad != 0).float().mean()))\n"
        "                    for g in self.param_groups for p in g['params'])\n"
        "        return super().step(closure)\n"
        "class Tokens(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.table = nn.Embedding(1000, 4)\n"
        "    def forward(self, ids):\n"
        "        return self.table(ids).flatten(1)\n"
        "def build_model():\n"
        "    return nn.Sequential(Tokens(), nn.Linear(8, 2))\n"
        "def make_batch(b):\n"
        "    return torch.randint(0, 1000, (b, 2)), torch.randint(0, 2, (b,))\n"
        "def loss_fn(out, target):\n"
        "    return nn.functional.cross_entropy(out, target)\n"
        "def build_optimizer(params):\n"
        "    return Recording(params, lr=0.1)\n"
    )
    spec = load_model_file(path)
    profile = profile_model(spec, batch_size=4, micro_batch_sizes=[4], repeats=2)
    seen = dict(spec.build_optimizer.__globals__["SEEN"])
    assert profile.optimizer_step_ms > 0
    assert 0 < seen[(1000, 4)] <= 8 / 1000 + 1e-6  # the rows of at most 4 x 2 tokens: the others stay zero
    assert seen[(2, 8)] == seen[(2,)] == 1.0  # the linear layer's gradients: none zero


class _RMSNormFirst(torch.nn.Module):
    """x * rsqrt(mean(x^2)) * w, then a Linear: the pow saves the input before any parameter (Llama's RMSNorm)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight)


@pytest.mark.parametrize("first, kept", [("layernorm", False), ("rmsnorm", True)])
def test_a_checkpointed_w_says_whether_the_saved_input_outlives_its_passes(first, kept):
    # LayerNorm saves its input, and its weight's pass walks its node (the saved input goes); RMSNorm's pow saves it
    # before the weight, where no pass walks (it stays as long as a later layer's graph holds the recompute).
    from autotune.profiling import _checkpoint_weight_bytes, _Surrogate, _Unit

    width = 32
    block = (torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width)) if first == "layernorm"
             else _RMSNormFirst(width))
    x = torch.randn(8, width, requires_grad=True)
    _, passes = _checkpoint_weight_bytes(_Unit(block, block, last=False), ((x,), {}), _Surrogate())
    assert passes is not None and passes.input_kept is kept


def test_checkpointing_ratios_come_from_the_window_checkpointed_once(monkeypatch):
    """A stage is checkpointed once for all its blocks (runtime.CheckpointedStage): the ratios come from the blocks
    timed together, checkpointed once, not from one block checkpointed alone (which put the 13-layer MLP's stage
    at twice what it paid)."""
    import autotune.profiling as profiling

    stages = []

    def stage_pass(units, inputs, loss_fn, clock, *, checkpointed):
        stages.append((len(units), checkpointed))
        if len(units) == 1:  # a block alone: what the ratios came from before (3 / 6 here)
            return (6.0, 16.0) if checkpointed else (2.0, 4.0)
        return (3.0, 7.0) if checkpointed else (2.0, 4.0)

    monkeypatch.setattr(profiling, "_stage_pass", stage_pass)
    profile = profile_model(load_model_file(RECIPES / "mlp.py"), batch_size=8, micro_batch_sizes=[8, 2], repeats=1)
    assert {n for n, _ in stages} == {1, 10}  # each block alone, and the recipe's ten blocks as one window
    assert {c for n, c in stages if n == 10} == {False, True}
    assert profile.checkpoint_forward_ratio == (1.5, 1.5)  # 3 / 2
    assert profile.checkpoint_recompute_ratio == (1.5, 1.5)  # (7 - 4) / 2


def test_a_stage_pass_checkpoints_its_blocks_once(monkeypatch):
    import autotune.profiling as profiling

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3)]
    units = [profiling._Unit(b, b, last=i == 2) for i, b in enumerate(blocks)]
    x = torch.randn(4, 8, requires_grad=True)
    calls = []
    real = profiling.checkpoint
    monkeypatch.setattr(profiling, "checkpoint", lambda fn, *a, **k: calls.append(fn) or real(fn, *a, **k))

    def grads(checkpointed):
        for b in blocks:
            b.zero_grad(set_to_none=True)
        forward, backward = profiling._stage_pass(units, ((x,), {}), lambda out: out.square().sum(),
                                                  profiling._CpuClock(), checkpointed=checkpointed)
        assert forward > 0 and backward > 0
        return [p.grad.clone() for b in blocks for p in b.parameters()]

    plain = grads(False)
    assert calls == []
    checkpointed = grads(True)
    assert len(calls) == 1  # one checkpoint over the three blocks
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b)


def test_a_block_timed_alone_keeps_its_own_checkpointing_times():
    """A window that ran out of memory timed together is timed a block at a time: no stage pass, the block's own."""
    from autotune.profiling import _SizeResult, _stage_ratio_pairs

    alone = _SizeResult(plain=(2.0, 4.0), checkpointed=(3.0, 6.0))
    assert _stage_ratio_pairs(alone) == ([(2.0, 4.0)], [(3.0, 6.0)])
    together = dataclasses.replace(alone, stage_plain=(20.0, 40.0), stage_checkpointed=(25.0, 50.0))
    assert _stage_ratio_pairs(together) == ([(20.0, 40.0)], [(25.0, 50.0)])


IN_PLACE = """
import torch
from torch import nn

class Halves(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(0.5)
        return self.lin(x)

def build_model():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), LAST)

def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 8)

def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)
"""


def test_an_in_place_first_operation_is_profiled_out_of_place_or_named_with_the_fix(tmp_path):
    """A block is timed on a leaf input that needs its gradient, as a stage receives it: an nn.ReLU(inplace=True)
    child failed the whole profile ('a leaf Variable that requires grad is being used in an in-place operation')
    and is now run out of place; an in-place operation in the block's own code is named, with the fix."""
    from autotune.errors import ModelFileError
    from autotune.model_file import build_skeleton

    (tmp_path / "relu.py").write_text(IN_PLACE.replace("LAST", "nn.ReLU(inplace=True)"))
    spec = load_model_file(tmp_path / "relu.py")
    assert [getattr(block, "inplace", None) for block in build_skeleton(spec).blocks] == [None, False, None, False]
    profile = profile_model(spec, batch_size=8, micro_batch_sizes=[2, 8], repeats=1)
    assert profile.n_layers == 4 and profile.micro_batch_sizes == (2, 8)
    (tmp_path / "halves.py").write_text(IN_PLACE.replace("LAST", "Halves()"))
    spec = load_model_file(tmp_path / "halves.py")
    with pytest.raises(ModelFileError, match=r"block 3 \(Halves\) failed .*in-place operation.*changes its input in "
                                             r"place.*`x = x \* a`, not `x.mul_\(a\)`"):
        profile_model(spec, batch_size=8, micro_batch_sizes=[2], repeats=1)


def test_host_probe_keeps_its_lowest_sample_over_the_profile(monkeypatch):
    """Profile.host_call_ms is the lowest of probes taken before the walk, after each block and after the optimizer
    and idle probes: one probe that falls in a slow phase of the host (x2 for seconds on a VM) is not the host."""
    from autotune import profiling

    readings = iter([0.11, 0.12, 0.09, 0.05, 0.13] + [0.10] * 40)  # one fast moment among slow ones
    taken = []
    timed = profiling._median_step_ms

    def probe(optimizer, clock, repeats):
        if repeats != profiling.HOST_CALL_REPEATS:
            return timed(optimizer, clock, repeats)  # the model's own optimizer steps
        taken.append(repeats)
        return next(readings)

    monkeypatch.setattr(profiling, "_median_step_ms", probe)
    spec = load_model_file(RECIPES / "mlp.py")
    calls = []
    profile = profile_model(spec, batch_size=4, micro_batch_sizes=[4], repeats=1,
                            progress=lambda done, total, what: calls.append(done))
    assert calls == list(range(1, 11))  # the caller's progress still told after each block
    assert len(taken) == 1 + 10 + 2  # before the walk, after each of 10 blocks, after each probe after it
    assert profile.host_call_ms == 0.05
