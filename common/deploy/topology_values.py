"""The checks a topology file's values pass before anything is rendered from them (common/deploy/topology_file.py):
each value typed against its field, strings free of control characters and of sane length, host names, ports,
names that become files and objects — every failure a `TopologyFileError` naming the key, because a value that
reaches a rendered file unchecked becomes a line of a script or a manifest on a cluster the operator cannot see."""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
import typing

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # site and cluster names become file, folder and object names
ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")
HOST = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|[0-9a-fA-F:.]*:[0-9a-fA-F:.]*)$")  # a name, IPv4 or IPv6
# Every value reaches a rendered file: a control character (a newline above all) would become a line of a
# script or a manifest, a very long one is a mistake (and shlex is quadratic on one long token).
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_TEXT = 4096  # characters of one string value
MAX_FLAGS = 16384  # characters of a worker_flags value
MAX_ITEMS = 1024  # items of a list, entries of a table


class TopologyFileError(ValueError):
    """A topology file that cannot be rendered; the message names the key (e.g. `sites.hpc.nodes`)."""


def take_keys(table: dict, where: str, allowed: typing.Iterable[str]) -> None:
    """Refuse keys outside `allowed`, naming the closest valid one."""
    allowed = sorted(allowed)
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.5)
            hint = f"; did you mean {'.'.join(filter(None, [where, close[0]]))!r}?" if close else ""
            raise TopologyFileError(f"{key_of(where, key)}: unknown key{hint} (valid here: {', '.join(allowed)})")


def key_of(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def typed_value(value: object, hint: object, key: str) -> object:
    """`value` checked against a field's annotation (str, int, float, bool, tuple[...], dict[str, str])."""
    origin = typing.get_origin(hint)
    if isinstance(value, (list, dict)) and len(value) > MAX_ITEMS:
        raise TopologyFileError(f"{key}: {len(value)} items, more than the {MAX_ITEMS} a list or table may have")
    if origin is tuple:
        if not isinstance(value, list):
            raise TopologyFileError(f"{key}: expected a list, got {type(value).__name__} {shown(value)}")
        return tuple(typed_value(item, typing.get_args(hint)[0], f"{key}[{i}]") for i, item in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise TopologyFileError(f"{key}: expected a table, got {type(value).__name__} {shown(value)}")
        for k, v in value.items():
            check_text(k, f"{key}.{k}")
            if origin is dict:
                typed_value(v, typing.get_args(hint)[1], f"{key}.{k}")
            elif isinstance(v, str):
                check_text(v, f"{key}.{k}")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise TopologyFileError(f"{key}: expected {hint.__name__}, got {type(value).__name__} {shown(value)}")
    if isinstance(value, str):
        check_text(value, key)
    return value


def shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}… ({len(text)} characters)"


def check_text(value: str, key: str, limit: int = MAX_TEXT) -> str:
    """A string value that may reach a rendered file: no control character, a sane length."""
    if len(value) > limit:
        raise TopologyFileError(f"{key}: {len(value)} characters, more than the {limit} a value may have")
    if CONTROL.search(value):
        raise TopologyFileError(
            f"{key}: {shown(value)} holds a control character (a newline would become a line of a "
            "rendered script or manifest)"
        )
    return value


def check_host(value: str, key: str) -> str:
    if len(value) > 253 or not HOST.match(value):
        raise TopologyFileError(f"{key}: {shown(value)} is not a host name or IP address")
    return value


def check_port(value: int, key: str, span: int = 1) -> int:
    """A TCP port, or the first of `span` consecutive ones."""
    if not 1 <= value <= 65536 - span:
        raise TopologyFileError(
            f"{key}: {value} is not a port" + (f" with {span - 1} more after it" if span > 1 else "") + " (1-65535)"
        )
    return value


def build_from(cls: type, table: dict, where: str, **fixed: object) -> object:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in fixed]
    take_keys(table, where, names)
    values = {name: typed_value(table[name], hints[name], key_of(where, name)) for name in names if name in table}
    return cls(**values, **fixed)


def parse_flags(text: object, key: str) -> tuple[str, ...]:
    if isinstance(text, list):
        return typing.cast(tuple, typed_value(text, tuple[str, ...], key))
    if not isinstance(text, str):
        raise TopologyFileError(f"{key}: expected str, got {type(text).__name__} {shown(text)}")
    try:  # bounded before shlex, which is quadratic on one long token
        return tuple(shlex.split(check_text(text, key, MAX_FLAGS)))
    except ValueError as error:
        raise TopologyFileError(f"{key}: {error}") from None


def positive(value: int, key: str, least: int = 1) -> int:
    if value < least:
        raise TopologyFileError(f"{key}: must be ≥ {least}, got {value}")
    return value


def choice(value: object, choices: tuple[str, ...], key: str) -> str:
    if value not in choices:
        raise TopologyFileError(f"{key}: {value!r} is not one of {', '.join(choices)}")
    return typing.cast(str, value)


def check_name(value: object, key: str) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise TopologyFileError(f"{key}: {value!r}: use letters, digits, '.', '_' and '-' (it names files and objects)")
    return value
