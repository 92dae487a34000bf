import pytest

from autotune import model_file
from autotune.errors import ModelFileError
from tests.conftest import RECIPES
from tests.fakes import TINY_MODEL

NON_SCALAR = TINY_MODEL.replace("nn.functional.mse_loss(output, target)", "(output - target) ** 2")


@pytest.mark.parametrize("threshold", [0, model_file.REAL_CHECK_MAX_BYTES], ids=["meta-device", "real"])
def test_check_model_catches_a_non_scalar_loss_either_way(tmp_path, monkeypatch, threshold):
    monkeypatch.setattr(model_file, "REAL_CHECK_MAX_BYTES", threshold)
    path = tmp_path / "model.py"
    path.write_text(NON_SCALAR)
    spec = model_file.load_model_file(path)
    with pytest.raises(ModelFileError, match="returned a tensor of shape"):
        model_file.check_model(spec, 8)


@pytest.mark.parametrize("recipe", ["mlp", "gpt", "cnn"])
def test_recipes_pass_the_meta_device_check(monkeypatch, recipe):
    monkeypatch.setattr(model_file, "REAL_CHECK_MAX_BYTES", 0)
    spec = model_file.load_model_file(RECIPES / f"{recipe}.py")
    model_file.check_model(spec, 4)
    assert spec.n_layers >= 8 and not spec.has_batchnorm


def test_batchnorm_is_found_inside_blocks(tmp_path):
    path = tmp_path / "bn.py"
    path.write_text(NON_SCALAR.replace(
        "nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))",
        "nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.BatchNorm1d(4), nn.ReLU()), nn.Linear(4, 2))"))
    spec = model_file.load_model_file(path)
    assert spec.has_batchnorm and spec.batchnorm_layers == (1,)


def test_a_model_file_may_set_its_precision_and_a_wrong_one_is_one_line(tmp_path):
    from autotune.devices import default_precision

    path = tmp_path / "model.py"
    path.write_text(TINY_MODEL)
    plain = model_file.load_model_file(path)
    assert plain.precision is None
    assert (default_precision("cuda", plain.precision), default_precision("cpu", plain.precision)) == ("bf16", "fp32")
    path.write_text(TINY_MODEL + '\nPRECISION = "bf16"\n')
    assert default_precision("cpu", model_file.load_model_file(path).precision) == "bf16"
    path.write_text(TINY_MODEL + '\nPRECISION = "fp16"\n')
    with pytest.raises(ModelFileError, match=r"PRECISION = 'fp16'; set it to 'fp32' or 'bf16'"):
        model_file.load_model_file(path)


def test_data_parallel_modes_parse_from_one_flag():
    from autotune.cli.options import parse_data_parallel
    from autotune.errors import UsageError

    assert parse_data_parallel("replicate, Shard,shard") == ("replicate", "shard")
    for wrong in ("zero3", ","):
        with pytest.raises(UsageError, match="comma-separated list of replicate, shard"):
            parse_data_parallel(wrong)


@pytest.mark.parametrize("threshold", [0, model_file.REAL_CHECK_MAX_BYTES], ids=["meta-device", "real"])
def test_a_model_that_reads_a_tensor_it_made_while_built_loads(tmp_path, monkeypatch, threshold):
    """torchvision's RegNet computes its stage widths with tensors and turns them into a list: built with every
    tensor on the meta device, that ended in "build_model raised NotImplementedError: Cannot copy out of meta
    tensor"; it is built again with only its parameters on the meta device."""
    monkeypatch.setattr(model_file, "REAL_CHECK_MAX_BYTES", threshold)
    path = tmp_path / "widths.py"
    path.write_text(TINY_MODEL.replace(
        "    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))",
        "    width = int((torch.arange(3) * 2).tolist()[-1])\n"
        "    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))"))
    spec = model_file.load_model_file(path)
    model_file.check_model(spec, 8)
    assert spec.n_layers == 3 and spec.parameter_bytes[0] == (4 * 4 + 4) * 4
    (tmp_path / "broken.py").write_text(TINY_MODEL.replace("return nn.Sequential(", "return nn.Sequentia("))
    with pytest.raises(ModelFileError, match=r"broken.py:5: build_model raised AttributeError"):
        model_file.load_model_file(tmp_path / "broken.py")
