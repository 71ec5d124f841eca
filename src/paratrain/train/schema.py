"""What each config field accepts: types and ranges, checked before any process starts.

One mechanism, driven by data, for every config dataclass (``GPTConfig`` and the sections
of ``train/config.py``):

- The **type** is the field's annotation. ``int`` takes an integer (not 5.5, "5" or
  true); ``float`` takes an integer or a finite float (never nan or inf); ``bool`` takes
  only true or false; ``str`` takes a string. ``Literal[...]`` lists the choices, and a
  choice must also have the choice's type (``zero = true`` is not stage 1).
- The **range** of a number is its entry in ``LIMITS``, keyed by field name (field names
  are unique across sections): ``min`` / ``max`` are inclusive, ``above`` / ``below``
  exclusive. A number with no entry must be at least 0: every count, size, rate, seed and
  time in a config is.

So a field added to a config dataclass is checked by its annotation with no further code;
give it a ``LIMITS`` entry when 0 is not its lower bound. Other annotations (lists,
optionals...) are passed through unchecked. ``check`` returns the resolved values (an
integer given to a float field becomes a float) and the problems, each naming the field,
its TOML section and its flag; it never raises and never mutates.

A TOML file holds one table per section; ``flatten`` refuses a key in the wrong table
naming the table it belongs to, and an unknown key naming the closest known one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


LIMITS: dict[str, dict[str, float]] = {
    # [model] (GPTConfig)
    "vocab_size": {"min": 1}, "d_model": {"min": 1}, "n_layers": {"min": 1},
    "n_heads": {"min": 1}, "max_seq_len": {"min": 1}, "rope_theta": {"above": 0},
    "norm_eps": {"above": 0}, "init_std": {"above": 0}, "top_k": {"min": 1}, "moe_every": {"min": 1},
    "routed_scale": {"above": 0},
    # [parallel]
    "tp": {"min": 1}, "pp": {"min": 1}, "cp": {"min": 1}, "ep": {"min": 1}, "virtual_stages": {"min": 1},
    "bucket_mb": {"above": 0}, "compress_start": {"min": -1}, "timeout_s": {"min": 1, "max": 1e7},  # a collective may take a second; ~4 months: no overflow
    # [data]
    "seq_len": {"min": 1}, "val_fraction": {"below": 1},
    # [optim]
    "lr": {"above": 0}, "beta1": {"below": 1}, "beta2": {"below": 1}, "eps": {"above": 0},
    # [train]
    "steps": {"min": 1}, "global_batch": {"min": 1}, "eval_batches": {"min": 1}, "log_every": {"min": 1},
    "seed": {"max": 2**32 - 1},
}
"""Ranges that differ from the default "a number is at least 0"."""

FLAG_NAMES = {"preset": "--model"}
"""Fields whose flag is not ``--field-name``."""


def where(section: str, name: str) -> str:
    """Where a user sets this field: ``(TOML [train] steps / --steps)``."""
    flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
    return f"(TOML [{section}] {name} / {flag})"


@lru_cache(maxsize=None)
def hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation (the modules use postponed annotations)."""
    return typing.get_type_hints(cls)


def choices(annotation: Any) -> tuple | None:
    """The options of a ``Literal`` annotation, else None."""
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None


def check(cls: type, values: Mapping[str, Any], section: str) -> tuple[dict[str, Any], list[str]]:
    """``values`` (field -> value; unknown names are the caller's business) checked against
    ``cls``: the resolved values and one message per bad field."""
    kinds = hints(cls)
    resolved, problems = {}, []
    for name, value in values.items():
        if name not in kinds:
            resolved[name] = value
            continue
        try:
            resolved[name] = _value(kinds[name], value, LIMITS.get(name, {}))
        except ValueError as exc:
            problems.append(f"{section}.{name}: {exc} {where(section, name)}")
    return resolved, problems


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"the string {value!r}"
    return repr(value)


def _value(kind: Any, value: Any, limits: Mapping[str, float]) -> Any:
    options = choices(kind)
    if options is not None:
        if not any(type(value) is type(o) and value == o for o in options):
            listed = ", ".join(repr(o) for o in options)
            raise ValueError(f"must be one of {listed}, got {_show(value)}")
        return value
    optional = _optional(kind)
    if optional is not None:
        return None if value is None else _value(optional, value, limits)
    if kind is bool:
        if type(value) is not bool:
            raise ValueError(f"expected true or false, got {_show(value)}")
        return value
    if kind is int:
        if type(value) is not int:
            hint = "; write it without quotes" if _is_int_text(value) else ""
            raise ValueError(f"expected an integer, got {_show(value)}{hint}")
        return _in_range(value, limits)
    if kind is float:
        if type(value) not in (int, float):
            raise ValueError(f"expected a number, got {_show(value)}")
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value}")
        return _in_range(float(value), limits)
    if kind is str and not isinstance(value, str):
        raise ValueError(f"expected a string, got {_show(value)}")
    return value


def _optional(kind: Any) -> Any:
    """``X`` for ``X | None`` / ``Optional[X]``, else None."""
    if typing.get_origin(kind) not in (typing.Union, types.UnionType):
        return None
    rest = [a for a in typing.get_args(kind) if a is not type(None)]
    return rest[0] if len(rest) == 1 else None


def _is_int_text(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lstrip("+-").isdigit()


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def _in_range(value: float, limits: Mapping[str, float]) -> float:
    low = limits.get("min", 0 if "above" not in limits else None)
    if low is not None and value < low:
        raise ValueError(f"must be at least {_num(low)}, got {value}")
    if "above" in limits and value <= limits["above"]:
        raise ValueError(f"must be above {_num(limits['above'])}, got {value}")
    if "max" in limits and value > limits["max"]:
        raise ValueError(f"must be at most {_num(limits['max'])}, got {value}")
    if "below" in limits and value >= limits["below"]:
        raise ValueError(f"must be below {_num(limits['below'])}, got {value}")
    return value


def describe_limits(name: str) -> str:
    """The range of a numeric field, for ``--help`` (``at least 1``)."""
    limits = LIMITS.get(name, {})
    parts = [f"at least {_num(limits.get('min', 0))}"] if "above" not in limits else []
    parts += [f"{word} {_num(limits[key])}" for key, word in
              (("above", "above"), ("max", "at most"), ("below", "below")) if key in limits]
    return ", ".join(parts)


# ---- TOML files: which table each field goes in ------------------------------------------

def read_toml(path: str) -> dict[str, Any]:
    """The tables of a TOML config file; a missing, unreadable or malformed file is a
    ConfigError saying which."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"config file {path!r} is a directory; give the path of a .toml file")
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {exc.start}); "
                          f"save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        if file.suffix.lower() == ".json":  # most often a Hugging Face model's config.json
            raise ConfigError(f"config file {path!r} is JSON, not a paratrain TOML file; for a "
                              f"Hugging Face model pass its directory: --model {file.parent}") from None
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None


def _fields_of(section: str, tables: Mapping[str, type]) -> set[str]:
    names = {f.name for f in dataclasses.fields(tables[section])}
    return names | {"preset"} if section == "model" else names


def home(name: str, tables: Mapping[str, type]) -> str | None:
    """The table (section) a field belongs to, if any."""
    return next((s for s in tables if name in _fields_of(s, tables)), None)


def flatten(data: dict[str, Any], path: str, tables: Mapping[str, type]) -> dict[str, Any]:
    """TOML tables -> {"section.field": value}, refusing unknown and misplaced names."""
    flat, problems = {}, []
    for section, table in data.items():
        if section not in tables:
            owner = home(section, tables)
            problems.append(f"{section} = ... at the top level of {path}: put it under [{owner}]"
                            if owner else f"unknown section(s) [{section}] in {path}; sections "
                            f"are {', '.join(tables)}")
            continue
        if not isinstance(table, dict):
            problems.append(f"{section} = ... in {path} must be a table: [{section}]")
            continue
        known = _fields_of(section, tables)
        for key, value in table.items():
            owner = home(key, tables)
            if key in known:
                flat[f"{section}.{key}"] = value
            elif owner:
                problems.append(f"[{section}] {key}: {key} belongs in [{owner}], not [{section}]; "
                                f"move it there")
            else:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                problems.append(f"[{section}] {key}: unknown field{hint}; known fields: "
                                f"{', '.join(sorted(known))}")
    if problems:
        raise ConfigError("\n".join(problems))
    return flat
