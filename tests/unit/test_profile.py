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
    assert calls == [(1, 4, "warm-up at micro-batch size 2"), (2, 4, "warm-up at micro-batch size 8"),
                     (3, 4, "timing round 1 of 2"), (4, 4, "timing round 2 of 2")]
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
    assert profile.optimizer_state_bytes == pytest.approx(2 * profile.parameter_bytes, rel=0.01)  # AdamW
    assert 0 < profile.optimizer_peak_bytes <= 3 * profile.parameter_bytes  # foreach temporaries
    assert profile.loss_forward_ms[0] > 0 and profile.loss_backward_ms[0] > 0
    assert [layer.parameter_groups for layer in profile.layers] == [1] * 10  # one Linear each
    # Checkpointing measured, not assumed: a forward again (with bookkeeping) in the backward, per size.
    assert len(profile.checkpoint_forward_ratio) == len(profile.checkpoint_recompute_ratio) == 2
    # (ratios of two timings: on a loaded machine they wander far from 1, so only measured-ness is checked here)
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
    assert profile.input_bytes == (m * 8 * 4,)
    assert [layer.parameter_bytes for layer in profile.layers] == [(8 * 16 + 16) * 4, 0, (16 * 16 + 16) * 4,
                                                                    (16 * 4 + 4) * 4]


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


def test_batchnorm_models_skip_micro_batch_one_and_a_failing_size_is_named(tmp_path):
    from autotune.errors import ModelFileError
    from autotune.model_file import load_model_file
    from autotune.profiling import profile_model
    from tests.fakes import BATCHNORM_MODEL

    path = tmp_path / "bn.py"
    path.write_text(BATCHNORM_MODEL)
    spec = load_model_file(path)
    assert profile_model(spec, batch_size=8, repeats=1).micro_batch_sizes[0] == 2
    with pytest.raises(ModelFileError, match=r"micro-batch size 1 failed \(ValueError: Expected more than 1 value"):
        profile_model(spec, batch_size=8, micro_batch_sizes=[1, 2], repeats=1)
