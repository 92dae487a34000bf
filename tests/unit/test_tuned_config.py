"""Tuned config: schema order, round trip, atomic write, and one clear ConfigError per kind of bad file."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import autotune.files as files
from autotune.candidate import Candidate, Measurement
from autotune.config_file import dump_config, load_config, save_config
from autotune.errors import ConfigError
from autotune.schedules import Schedule
from autotune.tuned_config import (
    Environment,
    MeasuredResult,
    PredictedResult,
    SearchSummary,
    TunedConfig,
    mask_password,
)

SCHEMA_ORDER = [
    "version",
    "model",
    "model_sha256",
    "model_layers",
    "gpus",
    "global_batch_size",
    "micro_batch_size",
    "num_microbatches",
    "pipeline_degree",
    "data_parallel_degree",
    "schedule",
    "layers_per_stage",
    "activation_checkpointing",
    "wire_dtype",
    "precision",
    "memory_limit_bytes",
    "measured",
    "predicted",
    "search",
    "environment",
]


def make_config(**changes: Any) -> TunedConfig:
    fields: dict[str, Any] = {
        "model": "recipes/gpt.py",
        "model_sha256": "0123456789abcdef",
        "model_layers": 10,
        "gpus": 4,
        "global_batch_size": 64,
        "micro_batch_size": 8,
        "num_microbatches": 8,
        "pipeline_degree": 4,
        "data_parallel_degree": 1,
        "schedule": Schedule.ONE_F_ONE_B,
        "layers_per_stage": (3, 2, 2, 3),
        "activation_checkpointing": False,
        "wire_dtype": "float32",
        "memory_limit_bytes": 40 * 2**30,
        "measured": MeasuredResult(
            step_time_ms=123.25, throughput_samples_per_s=519.27, peak_memory_bytes=(9, 8, 7, 6)
        ),
        "predicted": PredictedResult(step_time_ms=120.5, peak_memory_bytes=(10, 9, 8, 7)),
        "search": SearchSummary(study="gpt", storage="sqlite:///autotune.db", trials=40, feasible=31, best_trial=17),
        "environment": Environment(device="NVIDIA H100", torch="2.13.0", autotune="0.1.0", python="3.11.7"),
    }
    fields.update(changes)
    return config_of(fields)


def config_of(fields: dict[str, Any]) -> TunedConfig:
    """A config from the file's flat keys (gpus, num_microbatches, ...), the candidate built from them."""
    candidate = Candidate(
        schedule=fields.pop("schedule"),
        pipeline_degree=fields.pop("pipeline_degree"),
        data_parallel_degree=fields.pop("data_parallel_degree"),
        global_batch_size=fields.pop("global_batch_size"),
        n_microbatches=fields.pop("num_microbatches"),
        layers_per_stage=fields.pop("layers_per_stage"),
        activation_checkpointing=fields.pop("activation_checkpointing"),
        wire_dtype=fields.pop("wire_dtype"),
    )
    gpus, micro = fields.pop("gpus"), fields.pop("micro_batch_size")
    assert (gpus, micro) == (candidate.world_size, candidate.micro_batch_size)
    return TunedConfig(candidate=candidate, **fields)


def write_dict(tmp_path: Path, data: Any, name: str = "autotune.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def valid_dict() -> dict[str, Any]:
    return make_config().to_dict()


# ---------------------------------------------------------------------------------------------- round trip


def interleaved(**fields: Any) -> TunedConfig:
    """Interleaved1F1B over pp 2 x dp 2 with checkpointing and a bfloat16 wire: every optional field set."""
    return make_config(schedule=Schedule.INTERLEAVED_1F1B, pipeline_degree=2, data_parallel_degree=2,
                       num_microbatches=4, layers_per_stage=(3, 3, 2, 2), activation_checkpointing=True,
                       wire_dtype="bfloat16", **fields)


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    config = interleaved(
        memory_limit_bytes=None,
        predicted=PredictedResult(),
        search=SearchSummary(),
    )
    path = save_config(config, tmp_path / "autotune.yaml")
    assert load_config(path) == config


def test_file_lists_keys_in_schema_order_with_a_header(tmp_path: Path) -> None:
    path = save_config(make_config(), tmp_path / "autotune.yaml", command="autotune search recipes/gpt.py --gpus 4")
    text = path.read_text()
    assert list(yaml.safe_load(text)) == SCHEMA_ORDER
    assert text.startswith("# autotune tuned config, schema version 1.")
    assert "# Command: autotune search recipes/gpt.py --gpus 4" in text
    assert "of study 'gpt'" in text
    assert "layers_per_stage: [3, 2, 2, 3]" in text  # flow lists: readable
    assert "memory_limit_bytes: 42949672960  # 40.0 GiB" in text
    assert yaml.safe_load(text)["measured"] == {
        "step_time_ms": 123.25,
        "throughput_samples_per_s": 519.27,
        "peak_memory_bytes": [9, 8, 7, 6],
    }


def test_unknown_keys_are_kept_and_written_back(tmp_path: Path) -> None:
    data = valid_dict()
    data["tuned_by"] = {"team": "infra"}
    path = write_dict(tmp_path, data)
    config = load_config(path)
    assert config.extra == {"tuned_by": {"team": "infra"}}
    assert yaml.safe_load(dump_config(config))["tuned_by"] == {"team": "infra"}


def test_missing_wire_dtype_means_float32(tmp_path: Path) -> None:
    data = valid_dict()
    del data["wire_dtype"]
    assert load_config(write_dict(tmp_path, data)).wire_dtype == "float32"


def test_layer_roles_are_optional_and_round_trip(tmp_path: Path) -> None:
    data = valid_dict()
    assert "layer_roles" not in data and load_config(write_dict(tmp_path, data)).layer_roles is None
    assert "layer_roles" not in yaml.safe_load(dump_config(load_config(write_dict(tmp_path, data))))
    roles = ["embedding"] + ["block"] * 8 + ["head"]
    data["layer_roles"] = roles
    config = load_config(write_dict(tmp_path, data))
    assert config.layer_roles == tuple(roles)
    assert yaml.safe_load(dump_config(config))["layer_roles"] == roles


def test_rank_order_and_nodes_are_optional_and_round_trip(tmp_path: Path) -> None:
    data = valid_dict()
    config = load_config(write_dict(tmp_path, data))
    assert config.rank_order == "pp-inner" and config.nodes is None and config.gpus_per_node is None
    assert not {"rank_order", "nodes", "gpus_per_node"} & set(yaml.safe_load(dump_config(config)))
    data.update(rank_order="dp-inner", nodes=2, gpus_per_node=2)
    config = load_config(write_dict(tmp_path, data))
    assert (config.rank_order, config.nodes, config.gpus_per_node) == ("dp-inner", 2, 2)
    assert config.candidate.rank_order == "dp-inner"
    written = yaml.safe_load(dump_config(config))
    assert (written["rank_order"], written["nodes"], written["gpus_per_node"]) == ("dp-inner", 2, 2)
    data["rank_order"] = "sideways"
    with pytest.raises(ConfigError, match="rank_order 'sideways' is not one of pp-inner, dp-inner"):
        load_config(write_dict(tmp_path, data))


def test_an_asynchronous_schedule_is_said_outright_and_round_trips(tmp_path: Path) -> None:
    """2BW's config records `asynchronous: true` after the candidate's keys (a synchronous one's has no such key);
    a file whose asynchronous contradicts its schedule is refused with the fix."""
    assert "asynchronous" not in valid_dict()
    config = make_config(schedule=Schedule.TWO_BW)
    data = config.to_dict()
    assert data["schedule"] == "2BW" and data["asynchronous"] is True
    assert list(data).index("asynchronous") == list(data).index("precision") + 1  # the candidate's last key here
    path = save_config(config, tmp_path / "autotune.yaml")
    loaded = load_config(path)
    assert loaded.candidate == config.candidate and loaded.to_dict() == data
    # the header points at setup_pipeline, not at export (which refuses 2BW)
    header = path.read_text().split("\nversion:")[0]
    assert "autotune.runtime.setup_pipeline" in header and "autotune export" not in header
    synchronous = save_config(make_config(), tmp_path / "sync.yaml").read_text()
    assert "autotune export" in synchronous and "setup_pipeline" not in synchronous
    data["asynchronous"] = False
    with pytest.raises(ConfigError, match="asynchronous is False but schedule 2BW is asynchronous; set "
                                          "asynchronous: true"):
        load_config(write_dict(tmp_path, data))
    data = valid_dict() | {"asynchronous": True}
    with pytest.raises(ConfigError, match="schedule 1F1B is not asynchronous; set asynchronous: false"):
        load_config(write_dict(tmp_path, data))


def test_candidate_property_matches_the_config() -> None:
    config = interleaved()
    c = config.candidate
    assert c == Candidate(
        schedule=Schedule.INTERLEAVED_1F1B,
        pipeline_degree=2,
        data_parallel_degree=2,
        global_batch_size=64,
        n_microbatches=4,
        layers_per_stage=(3, 3, 2, 2),
        activation_checkpointing=True,
        wire_dtype="bfloat16",
    )
    assert (c.micro_batch_size, c.world_size) == (config.micro_batch_size, config.gpus)


def test_from_measurement(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text("# a model file\n")
    candidate = Candidate(
        schedule=Schedule.GPIPE,
        pipeline_degree=2,
        data_parallel_degree=2,
        global_batch_size=32,
        n_microbatches=4,
        layers_per_stage=(4, 3),
    )
    measurement = Measurement(
        candidate=candidate,
        status="ok",
        step_time_ms=50.0,
        peak_memory_bytes=(1, 2, 3, 4),
        device="cpu",
    )
    config = TunedConfig.from_measurement(
        measurement,
        model=model,
        memory_limit_bytes=None,
        search=SearchSummary(study="s", storage="postgresql://bob:hunter2@db:5432/optuna", trials=3, feasible=2),
    )
    assert config.candidate == candidate
    assert (config.gpus, config.micro_batch_size, config.model_layers) == (4, 4, 7)
    assert config.model_sha256 == hashlib.sha256(model.read_bytes()).hexdigest()[:16]
    assert config.measured.throughput_samples_per_s == pytest.approx(32 / 0.05)  # computed when missing
    assert config.search.storage == "postgresql://bob:***@db:5432/optuna"
    assert config.environment.device == "cpu"
    assert config.environment.python == ".".join(map(str, sys.version_info[:3]))
    assert load_config(save_config(config, tmp_path / "c.yaml")) == config


def test_from_measurement_refuses_a_failed_trial() -> None:
    candidate = make_config().candidate
    with pytest.raises(ConfigError, match="status 'oom'"):
        TunedConfig.from_measurement(
            Measurement(candidate=candidate, status="oom"),
            model="m.py",
            model_sha256="x",
            memory_limit_bytes=None,
        )


def test_mask_password() -> None:
    assert mask_password("mysql://u:pw@[::1]:3306/db") == "mysql://u:***@[::1]:3306/db"
    assert mask_password("sqlite:///autotune.db") == "sqlite:///autotune.db"


# ---------------------------------------------------------------------------------------------- atomic write


def test_save_leaves_no_temp_file_and_creates_directories(tmp_path: Path) -> None:
    path = save_config(make_config(), tmp_path / "out" / "autotune.yaml")
    assert sorted(p.name for p in path.parent.iterdir()) == ["autotune.yaml"]


@pytest.mark.parametrize("fail_in", ["replace", "fsync"])
def test_failed_save_keeps_the_old_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_in: str) -> None:
    path = save_config(make_config(), tmp_path / "autotune.yaml")
    before = path.read_bytes()

    def boom(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, fail_in, boom)
    with pytest.raises(ConfigError, match=r"autotune\.yaml: cannot be written \(No space left on device\)"):
        save_config(make_config(global_batch_size=128, num_microbatches=16), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["autotune.yaml"]


def test_the_target_is_never_torn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to the rename the target holds the old text; the new text is complete before it takes the name."""
    path = save_config(make_config(), tmp_path / "autotune.yaml")
    old = path.read_text()
    new_config = make_config(global_batch_size=128, num_microbatches=16)
    seen: list[str] = []
    real_replace = os.replace

    def checked_replace(src: str, dst: Path) -> None:
        assert Path(dst).read_text() == old
        assert Path(src).parent == path.parent  # same directory: the rename is atomic
        assert load_config(src) == new_config
        seen.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", checked_replace)
    save_config(new_config, path)
    assert seen and load_config(path) == new_config


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_save_keeps_the_file_mode(tmp_path: Path) -> None:
    path = save_config(make_config(), tmp_path / "new.yaml")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600
    path.chmod(0o600)
    save_config(make_config(), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# ---------------------------------------------------------------------------------------------- load errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such file; pass the YAML file written by"):
        load_config(tmp_path / "nope.yaml")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_a_study_database_for_the_config_names_the_yaml_and_the_report_flags(tmp_path: Path) -> None:
    """A user passes the search's .autotune/*.db for its config: the line says what it is and what to pass instead,
    with the study's own name where the database holds one."""
    import optuna

    path = tmp_path / "m-cpu-g2-b16.db"
    optuna.create_study(storage=f"sqlite:///{path}", study_name="m-cpu-g2-b16")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "is a search's study database, not a tuned config" in message
    assert f"--storage sqlite:///{path.as_posix()} --study-name m-cpu-g2-b16" in message
    optuna.create_study(storage=f"sqlite:///{path}", study_name="other")
    with pytest.raises(ConfigError, match=r"--study-name <m-cpu-g2-b16\|other>"):
        load_config(path)


def test_not_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\nmodel: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML \(.* at line \d+\); fix the file"):
        load_config(path)


@pytest.mark.parametrize("text", ["- just\n- a list\n", "", "42\n"])
def test_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="not a tuned config"):
        load_config(path)


@pytest.mark.parametrize(
    ("version", "fix"), [(2, "upgrade autotune"), (0, "write it again"), ("1", "write it again"), (True, "again")]
)
def test_unknown_schema_version(tmp_path: Path, version: Any, fix: str) -> None:
    data = valid_dict()
    data["version"] = version
    with pytest.raises(ConfigError, match=rf"schema version {re.escape(repr(version))} is not supported.*{fix}"):
        load_config(write_dict(tmp_path, data))


def test_missing_keys_are_named(tmp_path: Path) -> None:
    data = valid_dict()
    del data["gpus"], data["schedule"], data["measured"]["step_time_ms"]
    with pytest.raises(ConfigError, match=r"missing keys gpus, schedule, measured\.step_time_ms; add them"):
        load_config(write_dict(tmp_path, data))


def test_one_missing_key(tmp_path: Path) -> None:
    data = valid_dict()
    del data["environment"]
    with pytest.raises(ConfigError, match=r"missing key environment; add it"):
        load_config(write_dict(tmp_path, data))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("gpus", "four", "gpus must be an integer, not str 'four'"),
        ("gpus", True, "gpus must be an integer, not true"),
        ("activation_checkpointing", 3, "activation_checkpointing must be true or false, not int 3"),
        ("layers_per_stage", "3,2,2,3", "layers_per_stage must be a list of integers, not str '3,2,2,3'"),
        ("layers_per_stage", [3, 2.5], "layers_per_stage must be a list of integers"),
        ("measured", 5, "measured must be a mapping of keys, not int 5"),
        ("memory_limit_bytes", "40GiB", "memory_limit_bytes must be an integer or null, not str '40GiB'"),
        ("model", None, "model must be a string, not null"),
    ],
)
def test_wrong_types(tmp_path: Path, key: str, value: Any, message: str) -> None:
    data = valid_dict()
    data[key] = value
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(write_dict(tmp_path, data))


def test_wrong_nested_type(tmp_path: Path) -> None:
    data = valid_dict()
    data["search"]["trials"] = "many"
    data["predicted"]["step_time_ms"] = "fast"
    with pytest.raises(
        ConfigError,
        match=r"predicted\.step_time_ms must be a number or null, not str 'fast'; "
        r"search\.trials must be an integer, not str 'many'; fix the values",
    ):
        load_config(write_dict(tmp_path, data))


def test_unknown_schedule_and_wire_dtype(tmp_path: Path) -> None:
    data = valid_dict()
    data["schedule"] = "Zigzag"
    with pytest.raises(ConfigError, match=r"unknown schedule 'Zigzag'; set schedule to one of: GPipe, 1F1B"):
        load_config(write_dict(tmp_path, data))
    data = valid_dict()
    data["wire_dtype"] = "float16"
    with pytest.raises(ConfigError, match=r"wire_dtype 'float16' is not one of float32, bfloat16"):
        load_config(write_dict(tmp_path, data))


def test_schedule_is_case_insensitive(tmp_path: Path) -> None:
    data = valid_dict()
    data["schedule"] = "1f1b"
    assert load_config(write_dict(tmp_path, data)).schedule is Schedule.ONE_F_ONE_B


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"micro_batch_size": 4},
            "num_microbatches 8 x micro_batch_size 4 x data_parallel_degree 1 = 32, but global_batch_size is 64",
        ),
        ({"gpus": 8}, "pipeline_degree 4 x data_parallel_degree 1 = 4, but gpus is 8"),
        (
            {"layers_per_stage": [4, 3, 3]},
            "layers_per_stage [4, 3, 3] has 3 entries, not a multiple of pipeline_degree 4",
        ),
        ({"layers_per_stage": [3, 3, 3, 3]}, "layers_per_stage [3, 3, 3, 3] covers 12 layers but model_layers is 10"),
        ({"layers_per_stage": [5, 0, 2, 3]}, "layers_per_stage [5, 0, 2, 3] has an empty stage"),
        ({"gpus": 0, "pipeline_degree": 0}, "gpus is 0; it must be at least 1"),
        (
            {"num_microbatches": 2, "global_batch_size": 16},
            "1F1B needs at least as many micro-batches as stages (4), got 2",
        ),
    ],
)
def test_inconsistent_values(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    data = valid_dict()
    data.update(changes)
    path = write_dict(tmp_path, data)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {message}")) as info:
        load_config(path)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- layer roles, old files

OLD_FILE = """\
# autotune tuned config, schema version 1.
version: 1
model: recipes/mlp.py
model_sha256: 5d0f0e9d2a9c4b11
model_layers: 13
gpus: 2
global_batch_size: 256
micro_batch_size: 128
num_microbatches: 2
pipeline_degree: 2
data_parallel_degree: 1
schedule: GPipe
layers_per_stage: [7, 6]  # stages in model order
activation_checkpointing: false
memory_limit_bytes: null
measured:
  step_time_ms: 221.5
  throughput_samples_per_s: 1155.7
  peak_memory_bytes: [4194304, 3145728]
predicted:
  step_time_ms: 210.0
  peak_memory_bytes: [4000000, 3000000]
search:
  study: mlp-cpu-g2-b256
  storage: sqlite:///.autotune/mlp-cpu-g2-b256.db
  trials: 12
  feasible: 9
  best_trial: 4
environment:
  device: cpu
  torch: 2.13.0
  autotune: 0.1.0
  python: 3.11.7
"""


def test_a_file_written_before_wire_dtype_and_layer_roles_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(OLD_FILE)
    config = load_config(path)
    assert config.candidate == Candidate(
        schedule=Schedule.GPIPE, pipeline_degree=2, global_batch_size=256, n_microbatches=2, layers_per_stage=(7, 6)
    )
    assert config.wire_dtype == "float32" and config.layer_roles is None
    assert "layer_roles" not in yaml.safe_load(dump_config(config))


def test_layer_roles_round_trip_after_model_layers(tmp_path: Path) -> None:
    roles = ("embedding", "block", "block", "block", "block", "block", "block", "block", "block", "head")
    config = make_config(layer_roles=roles)
    path = save_config(config, tmp_path / "roles.yaml")
    keys = list(yaml.safe_load(path.read_text()))
    assert keys[keys.index("model_layers") + 1] == "layer_roles"
    assert load_config(path) == config and load_config(path).layer_roles == roles


@pytest.mark.parametrize(
    ("roles", "message"),
    [
        (["block"] * 9, "layer_roles has 9 entries but model_layers is 10"),
        (["block"] * 9 + ["decoder"], "layer_roles ['decoder'] are not among embedding, block, head, other"),
        ("block", "layer_roles must be a list of strings or null, not str 'block'"),
    ],
)
def test_bad_layer_roles(tmp_path: Path, roles: Any, message: str) -> None:
    data = valid_dict()
    data["layer_roles"] = roles
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(write_dict(tmp_path, data))


def test_the_schema_follows_the_dataclass_fields() -> None:
    """Every field of TunedConfig (the candidate as its flat keys) is a key of the file, in field order."""
    from autotune.config_file import _SECTIONS, _TOP

    # written only when they say something
    optional_here = ("layer_roles", "split_at", "layer_parameter_bytes", "rank_order", "nodes", "gpus_per_node",
                    "data_parallel_mode", "fsdp_reshard_after_forward", "tensor_parallel_degree")
    assert [k for k in _TOP if k not in optional_here] == SCHEMA_ORDER
    assert sorted(k for k in _TOP if k in optional_here) == sorted(optional_here)
    assert _TOP["memory_limit_bytes"].optional and _TOP["layers_per_stage"].kind == "ints"
    assert list(_SECTIONS["search"]) == ["study", "storage", "trials", "feasible", "best_trial"]
