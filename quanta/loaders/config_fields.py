"""Typed reads of JSON config fields (config.json, quantization configs, sidecars).

A config is JSON written by many tools, so any field may hold any JSON type. These getters return the
value only if it has the type the reader needs and otherwise raise a ConfigError naming the source file,
the key, the expected type and the value found, instead of a TypeError or ValueError from `int()`,
arithmetic or a method call further on. JSON booleans are never taken as integers.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from quanta.quant.errors import ConfigError

MISSING = object()


def _check(value: Any, ok: bool, key: str, expected: str, source: Path | str) -> Any:
    if not ok:
        raise ConfigError(f"{source}: {key} must be {expected}, got {type(value).__name__} {str(value)[:60]}")
    return value


def _get(cfg: dict[str, Any], keys: str | tuple[str, ...], default: Any, source: Path | str) -> tuple[str, Any]:
    """(the first of `keys` present with a non-null value, its value), or (keys[0], default)."""
    keys = (keys,) if isinstance(keys, str) else keys
    for key in keys:
        if cfg.get(key) is not None:
            return key, cfg[key]
    if default is MISSING:
        raise ConfigError(f"{source}: required field {' / '.join(keys)} is missing")
    return keys[0], default


def get_int(cfg: dict[str, Any], keys: str | tuple[str, ...], source: Path | str, default: Any = MISSING) -> Any:
    """An integer field (the first of `keys` present), or `default` when none is."""
    key, value = _get(cfg, keys, default, source)
    return value if value is default else \
        _check(value, type(value) is int, key, "an integer", source)


def get_number(cfg: dict[str, Any], keys: str | tuple[str, ...], source: Path | str, default: Any = MISSING) -> Any:
    """A finite number field (int or float), as float, or `default` when absent."""
    key, value = _get(cfg, keys, default, source)
    if value is default:
        return value
    number = type(value) in (int, float) and (type(value) is float or abs(value) < 2**1000)
    return _check(value, number and math.isfinite(value), key, "a finite number", source) * 1.0


def get_str(cfg: dict[str, Any], keys: str | tuple[str, ...], source: Path | str, default: Any = MISSING) -> Any:
    """A string field, or `default` when absent."""
    key, value = _get(cfg, keys, default, source)
    return value if value is default else _check(value, isinstance(value, str), key, "a string", source)


def get_bool(cfg: dict[str, Any], key: str, source: Path | str, default: bool) -> bool:
    """A boolean field, or `default` when absent."""
    _, value = _get(cfg, key, default, source)
    return _check(value, isinstance(value, bool), key, "true or false", source)


def get_str_list(cfg: dict[str, Any], keys: str | tuple[str, ...], source: Path | str) -> list[str]:
    """A list of strings (module names, patterns), [] when absent."""
    key, value = _get(cfg, keys, [], source)
    return list(_check(value, isinstance(value, list) and all(isinstance(v, str) for v in value), key,
                       "a list of strings", source))


def get_block(cfg: dict[str, Any], key: str, source: Path | str, default: Any = MISSING) -> Any:
    """A [rows, columns] block size of positive integers, as a tuple, or `default` when absent."""
    key, value = _get(cfg, key, default, source)
    if value is default:
        return value
    ok = isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)
    return tuple(_check(value, ok, key, "[rows, columns] of positive integers", source))


def get_dict(cfg: dict[str, Any], key: str, source: Path | str, default: Any = MISSING) -> Any:
    """A JSON object field, or `default` when absent."""
    key, value = _get(cfg, key, default, source)
    return value if value is default else _check(value, isinstance(value, dict), key, "a JSON object", source)
