"""The tuned config as a file: read and checked against the schema TunedConfig declares (each key's kind derived from
its field's type), written as YAML in schema order under a header that says how it was made, atomically."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import sqlite3
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from autotune.candidate import Candidate
from autotune.errors import ConfigError, UsageError
from autotune.files import atomic_write_text
from autotune.schedules import SCHEDULES, Schedule, parse_schedule
from autotune.tuned_config import (
    ASYNCHRONOUS_KEY,
    CANDIDATE_KEYS,
    LAYER_ROLES,
    OPTIONAL_KEYS,
    OPTIONAL_SECTION_KEYS,
    SCHEMA_VERSION,
    WIRE_DTYPES,
    TunedConfig,
    check_values,
    plain,
)
from autotune.units import format_bytes

# ---------------------------------------------------------------------------------------------- the schema

_Kind = Literal["int", "number", "str", "bool", "ints", "numbers", "strs", "section"]
_KIND_NAMES = {
    "int": "an integer",
    "number": "a number",
    "str": "a string",
    "bool": "true or false",
    "ints": "a list of integers",
    "numbers": "a list of numbers",
    "strs": "a list of strings",
    "section": "a mapping of keys",
}


@dataclass(frozen=True)
class _Key:
    """One key of the file: what its value must be, and the dataclass of a section."""

    kind: _Kind
    optional: bool = False
    """null is allowed."""
    section: type | None = None


def _key_of(hint: Any) -> _Key:
    """What a field's type annotation asks of the value in the file."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    if hint is bool:
        return _Key("bool", optional)
    if hint is int:
        return _Key("int", optional)
    if hint is float:
        return _Key("number", optional)
    if hint is str or typing.get_origin(hint) is Literal or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return _Key("str", optional)
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return _Key("ints" if item is int else "numbers" if item is float else "strs", optional)
    if dataclasses.is_dataclass(hint):
        return _Key("section", optional, section=hint)  # type: ignore[arg-type]
    raise TypeError(f"no file kind for the annotation {hint!r}")


def _schema() -> dict[str, _Key]:
    """Every top-level key of the file, in order, from TunedConfig's fields and the Candidate's."""
    hints = typing.get_type_hints(TunedConfig)
    candidate_hints = {**typing.get_type_hints(Candidate), "world_size": int, "micro_batch_size": int}
    keys: dict[str, _Key] = {}
    for f in dataclasses.fields(TunedConfig):
        if f.name == "candidate":
            keys.update((key, _key_of(candidate_hints[attribute])) for key, attribute in CANDIDATE_KEYS.items())
        elif f.name != "extra":
            keys[f.name] = _key_of(hints[f.name])
    return keys


_TOP = _schema()
_SECTIONS = {
    name: {
        f.name: _key_of(hint)
        for f in dataclasses.fields(key.section)
        for hint in [typing.get_type_hints(key.section)[f.name]]
    }
    for name, key in _TOP.items()
    if key.section is not None
}


# ---------------------------------------------------------------------------------------------- reading


def config_from_dict(data: Any, *, source: str = "<config>") -> TunedConfig:
    """Check plain data (from YAML or JSON) against schema version 1 and build the config; any problem is a
    ConfigError whose one line names it and the fix."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: holds {_describe(data)}, not a tuned config (a mapping of keys like version, model, "
            f"schedule); pass the YAML file written by `autotune search --output`"
        )
    version = data.get("version")
    if "version" in data and (version != SCHEMA_VERSION or isinstance(version, bool)):
        fix = (
            "upgrade autotune to read it"
            if isinstance(version, int) and version > SCHEMA_VERSION
            else ("write it again with `autotune search`")
        )
        raise ConfigError(
            f"{source}: schema version {version!r} is not supported (this autotune reads version {SCHEMA_VERSION}); "
            f"{fix}"
        )

    missing = [key for key in _TOP if key not in data and key not in OPTIONAL_KEYS]
    for section, keys in _SECTIONS.items():
        if isinstance(data.get(section), dict):
            missing += [
                f"{section}.{key}"
                for key in keys
                if key not in data[section] and f"{section}.{key}" not in OPTIONAL_SECTION_KEYS
            ]
    if missing:
        raise ConfigError(
            f"{source}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)}; add "
            f"{'them' if len(missing) > 1 else 'it'} or write the config again with `autotune search`"
        )

    defaults = _defaults()
    values = {key: data.get(key, defaults.get(key)) for key in _TOP}
    wrong = [_wrong_type(key, values[key], kind) for key, kind in _TOP.items() if key in data]
    for section, keys in _SECTIONS.items():
        if isinstance(data[section], dict):
            wrong += [
                _wrong_type(f"{section}.{key}", data[section][key], kind)
                for key, kind in keys.items()
                if key in data[section]
            ]
    problems = [problem for problem in wrong if problem]
    if problems:
        raise ConfigError(f"{source}: {'; '.join(problems)}; fix the value{'s' if len(problems) > 1 else ''}")

    try:
        values["schedule"] = parse_schedule(values["schedule"])
    except UsageError:
        names = ", ".join(s.value for s in Schedule)
        raise ConfigError(f"{source}: unknown schedule {data['schedule']!r}; set schedule to one of: {names}") from None
    asynchronous = SCHEDULES[values["schedule"]].asynchronous
    if data.get(ASYNCHRONOUS_KEY, asynchronous) is not asynchronous:
        raise ConfigError(
            f"{source}: {ASYNCHRONOUS_KEY} is {data[ASYNCHRONOUS_KEY]!r} but schedule {values['schedule'].value} is "
            f"{'' if asynchronous else 'not '}asynchronous; set {ASYNCHRONOUS_KEY}: {str(asynchronous).lower()}"
        )
    if values["wire_dtype"] not in WIRE_DTYPES:
        raise ConfigError(
            f"{source}: wire_dtype {values['wire_dtype']!r} is not one of {', '.join(WIRE_DTYPES)}; fix it"
        )
    roles = values["layer_roles"]
    if roles is not None and any(role not in LAYER_ROLES for role in roles):
        unknown = sorted({role for role in roles if role not in LAYER_ROLES})
        raise ConfigError(f"{source}: layer_roles {unknown} are not among {', '.join(LAYER_ROLES)}; fix them")
    try:
        check_values(values)
        sections = {name: _section(cls_keys, data[name], name) for name, cls_keys in _SECTIONS.items()}
        return TunedConfig(
            version=values["version"],
            model=values["model"],
            model_sha256=values["model_sha256"],
            model_layers=values["model_layers"],
            layer_roles=None if roles is None else tuple(roles),
            split_at=None if values["split_at"] is None else tuple(values["split_at"]),
            layer_parameter_bytes=_tuple(values["layer_parameter_bytes"]),
            candidate=Candidate(
                **{
                    attribute: _tuple(values[key])
                    for key, attribute in CANDIDATE_KEYS.items()
                    if attribute not in ("world_size", "micro_batch_size")
                }
            ),
            memory_limit_bytes=values["memory_limit_bytes"],
            nodes=values["nodes"],
            gpus_per_node=values["gpus_per_node"],
            **sections,
            extra={key: value for key, value in data.items() if key not in _TOP},
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _defaults() -> dict[str, Any]:
    """What an optional key means when the file leaves it out: the default of its field."""
    defaults: dict[str, Any] = {}
    for key in OPTIONAL_KEYS:
        owner, name = (Candidate, CANDIDATE_KEYS[key]) if key in CANDIDATE_KEYS else (TunedConfig, key)
        defaults[key] = plain(next(f.default for f in dataclasses.fields(owner) if f.name == name))
    return defaults


def _section(keys: Mapping[str, _Key], values: Mapping[str, Any], name: str) -> Any:
    """A section's dataclass from its checked values (numbers as float where the field is a float)."""
    cls = _TOP[name].section
    assert cls is not None
    converted = {
        key: float(values[key])
        if k.kind == "number" and values[key] is not None
        else tuple(float(v) for v in values[key])
        if k.kind == "numbers"
        else _tuple(values[key])
        for key, k in keys.items()
        if key in values  # an optional key left out keeps its field's default
    }
    return cls(**converted)


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _wrong_type(key: str, value: Any, kind: _Key) -> str | None:
    if value is None and kind.optional:
        return None
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {
        "int": is_int,
        "number": is_int or isinstance(value, float),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "ints": isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
        "numbers": isinstance(value, list)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value),
        "strs": isinstance(value, list) and all(isinstance(v, str) for v in value),
        "section": isinstance(value, dict),
    }[kind.kind]
    what = _KIND_NAMES[kind.kind] + (" or null" if kind.optional else "")
    return None if ok else f"{key} must be {what}, not {_describe(value)}"


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'} ({_short(value)})"
    return f"{type(value).__name__} {_short(value)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------------------------- reading and writing


def load_config(path: str | Path) -> TunedConfig:
    """Read a tuned config; any problem is a ConfigError whose one line names the problem and the fix."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; pass the YAML file written by `autotune search --output`") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory; pass the YAML file written by `autotune search --output`") from None
    except (OSError, UnicodeDecodeError) as exc:
        if _is_sqlite(path):  # the study's database beside it (.autotune/*.db), passed for the config
            names = _study_names(path)
            shown = names if len(names) <= 3 else [*names[:3], "..."]
            name = names[0] if len(names) == 1 else f"<{'|'.join(shown) or 'name'}>"
            raise ConfigError(
                f"{path}: is a search's study database, not a tuned config; pass the YAML file that search wrote "
                f"(autotune.yaml unless --output said otherwise), or to `autotune report` "
                f"--storage sqlite:///{path.as_posix()} --study-name {name}"
            ) from None
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{path}: cannot be read ({reason}); pass a readable tuned config") from None
    return parse_config(text, source=str(path))


def _is_sqlite(path: Path) -> bool:
    """Whether the file starts as an SQLite database does."""
    try:
        with path.open("rb") as file:
            return file.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def _study_names(path: Path) -> list[str]:
    """The Optuna studies in an SQLite study database, read-only; [] where it cannot say."""
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            return [row[0] for row in db.execute("SELECT study_name FROM studies ORDER BY study_id")]
    except sqlite3.Error:
        return []


def parse_config(text: str, *, source: str = "<config>") -> TunedConfig:
    """Parse the YAML text of a tuned config (see load_config)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(
            f"{source}: not valid YAML ({problem}{where}); fix the file or write it again with `autotune search`"
        ) from None
    return config_from_dict(data, source=source)


_INLINE_COMMENTS = {
    "num_microbatches": "B / (M x dp): micro-batches per pipeline per step",
    "layers_per_stage": "stages in model order",
}


def dump_config(config: TunedConfig, *, command: str | None = None, filename: str = "CONFIG") -> str:
    """The YAML text of a config: a header saying how it was produced, then the keys in schema order."""
    search, env = config.search, config.environment
    source = (
        f"the best of {search.trials} trials ({search.feasible} feasible) of study {search.study!r}"
        if search.study
        else "a single measured trial"
    )
    header = [
        f"# autotune tuned config, schema version {SCHEMA_VERSION}.",
        (
            f"# Written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} by autotune {env.autotune} "
            f"(torch {env.torch}, Python {env.python}) from {source},"
        ),
        (
            f"# measured in a real pipelined run on {config.gpus} rank(s) of {env.device}; `predicted` is the "
            "simulator's estimate."
        ),
    ]
    if command:
        header.append(f"# Command: {' '.join(command.splitlines())}")
    header.append(f"# Check it still holds: autotune check {filename}")
    if SCHEDULES[config.candidate.schedule].asynchronous:  # no trainer has an asynchronous schedule: export refuses it
        header.append("# Use it:               autotune.runtime.setup_pipeline in your training script under "
                      "torchrun (2BW: asynchronous, exports refuse it)")
    else:
        header.append(f"# Use it elsewhere:     autotune export {filename} --format torchtitan|deepspeed|megatron")
    body = yaml.dump(config.to_dict(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=10_000)
    comments = dict(_INLINE_COMMENTS)
    if config.memory_limit_bytes is not None:
        comments["memory_limit_bytes"] = format_bytes(config.memory_limit_bytes)
    lines = [_with_comment(line, comments) for line in body.splitlines()]
    return "\n".join(header + lines) + "\n"


def save_config(config: TunedConfig, path: str | Path, *, command: str | None = None) -> Path:
    """Write the config atomically: a reader sees the old file or the new one, never a torn one."""
    path = Path(path)
    try:
        atomic_write_text(path, dump_config(config, command=command, filename=str(path)))
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot be written ({exc.strerror or exc}); pass --output with a writable path"
        ) from None
    return path


class _Dumper(yaml.SafeDumper):
    """Block mappings, flow lists ([3, 2, 2, 3]), null written as null."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


def _represent_none(dumper: yaml.SafeDumper, _: None) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:null", "null")


_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(type(None), _represent_none)


def _with_comment(line: str, comments: Mapping[str, str]) -> str:
    key, sep, value = line.partition(":")
    if sep and value.strip() and key in comments:  # top-level scalar lines only: nested keys are indented
        return f"{line}  # {comments[key]}"
    return line
