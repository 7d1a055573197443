"""Where a command's flag values come from: command line > DILOCOX_<FLAG> environment > --config file > defaults.

Deployments configure processes in three ways: a checked-in run file (`--config run.toml`), the
container environment (docker-compose `environment:`), and a few explicit flags. Rather than each
subcommand reading them itself, the console script resolves them once, generically, for whatever
flags the chosen command defines: file and environment values become that parser's *defaults*, so an
explicit flag still wins and argparse does the rest (types, `--help`, required flags).

* File keys are flag names without the dashes (`inner-steps` or `inner_steps`). Tables named like a
  RunConfig group (`[model]`, `[inner]`, `[outer]`, `[wire]`, `[compress]`, `[parallel]`) hold that
  group's fields (`[inner] steps = 20` is `--inner-steps 20`), as `dilocox config show` prints them.
  A table named like a command (`[server]`, `[worker]`, ...; `[bench.wan]` for a nested one) applies
  to that command only and wins over top-level keys, so one file can serve every process of a run.
* A top-level key that this command lacks but another dilocox command has is ignored (the shared run
  file); a key no command has is an error naming the key and the file, and so is an unknown key in
  this command's own table.
* Environment: `DILOCOX_` + the flag name in upper case with `_` for `-` (`--run-id` → `DILOCOX_RUN_ID`,
  `--inner-steps` → `DILOCOX_INNER_STEPS`); `DILOCOX_CONFIG` names the file. Variables that match another
  command's flag are ignored (the environment is shared by everything in a container); one that matches
  no dilocox command's flag is an error naming it and the closest name (a typo must not go unnoticed). Booleans
  take true/false/1/0/yes/no/on/off; a TOML list for a text flag is joined with commas (`servers`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import pathlib
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

ENV_PREFIX = "DILOCOX_"
# Variables of that prefix that are not flags: the config file's path, the tokenizer cache, and the
# compose recipe's image settings (read by docker compose, not by a dilocox command).
OTHER_VARIABLES = frozenset(
    {"DILOCOX_CONFIG", "DILOCOX_CACHE_DIR", "DILOCOX_IMAGE", "DILOCOX_BASE_IMAGE", "DILOCOX_WHEELHOUSE"}
)
CONFIG_HELP = (
    "TOML (or .json) file of flag values: keys named like the flags, [model]/[inner]/... tables, [<command>] "
    f"tables; precedence: flags > {ENV_PREFIX}<FLAG> environment variables > this file > defaults"
)
_BOOLEAN = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


class SettingsError(ValueError):
    """A value from a config file or the environment that the command cannot take."""


def parse_bool(text: str) -> bool:
    """true/false, 1/0, yes/no, on/off (any case): the one spelling of booleans in flags, files and env."""
    lowered = text.strip().lower()
    if lowered not in _BOOLEAN:
        raise ValueError(f"expected true/false, got {text!r}")
    return _BOOLEAN[lowered]


def key_of(name: str) -> str:
    """The canonical form of a flag or key name: `--inner-steps`, `inner-steps`, `inner_steps` → `inner_steps`."""
    return name.lstrip("-").replace("-", "_").lower()


def env_name(option: str) -> str:
    return ENV_PREFIX + key_of(option).upper()


def subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def option_map(
    parsers: Iterable[argparse.ArgumentParser],
) -> dict[str, tuple[argparse.ArgumentParser, argparse.Action]]:
    """{canonical key: (owning parser, action)} for every long option that takes a value or a switch."""
    skip = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    found = {}
    for parser in parsers:
        for action in parser._actions:
            if isinstance(action, skip):
                continue
            for option in action.option_strings:
                if option.startswith("--") and key_of(option) != "config":
                    found[key_of(option)] = (parser, action)
    return found


def load_file(path: str | os.PathLike) -> dict:
    p = pathlib.Path(path)
    if not p.is_file():
        raise SettingsError(f"config file {p} does not exist")
    try:
        return json.loads(p.read_text()) if p.suffix == ".json" else tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SettingsError(
            f"config file {p} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {error}"
        ) from None


# The run configuration's groups and their flags' prefixes: `[inner] steps` in a file is `--inner-steps`.
# config/run.py generates RunConfig's flags from this same table, so files and flags cannot drift apart.
GROUP_FLAG_PREFIXES = {
    "model": "",
    "parallel": "",
    "inner": "inner-",
    "outer": "outer-",
    "wire": "wire-",
    "compress": "compress-",
}
_RUN_GROUPS = ("model", "inner", "outer", "wire", "compress", "parallel")


def _group_prefixes() -> dict[str, str]:
    return {group: key_of(prefix) for group, prefix in GROUP_FLAG_PREFIXES.items()}


def flatten_file(data: Mapping[str, Any], command_path: list[str], commands: Iterable[str]) -> tuple[dict, dict]:
    """Split a config file into (shared keys, this command's own keys), both {canonical key: value}."""
    shared: dict[str, Any] = {}
    own: dict[str, Any] = {}
    commands = set(commands)
    for key, value in data.items():
        if not isinstance(value, dict):
            shared[key_of(key)] = value
        elif key in _RUN_GROUPS:
            prefix = _group_prefixes()[key]
            for sub, v in value.items():
                if isinstance(v, dict):
                    raise SettingsError(f"[{key}.{sub}] is not a known table")
                shared[prefix + key_of(sub)] = v
        elif key in commands:
            if key != command_path[0]:
                continue  # another command's table
            for sub, v in value.items():
                if not isinstance(v, dict):
                    own[key_of(sub)] = v
                elif len(command_path) > 1 and sub == command_path[1]:
                    own.update({key_of(k): x for k, x in v.items()})  # [bench.wan]: beats [bench]
        else:
            raise SettingsError(f"unknown table [{key}] (tables: {', '.join(_RUN_GROUPS)} or a command name)")
    return shared, own


def all_command_keys(commands: Mapping[str, tuple[str, str]]) -> set[str]:
    """Every flag of every dilocox command (imports them all: used only when a file has a foreign key)."""
    keys: set[str] = set()
    for module, _help in commands.values():
        try:
            parser = argparse.ArgumentParser(add_help=False)
            importlib.import_module(module).add_arguments(parser)
        except Exception:  # noqa: BLE001 - an optional dependency missing: that command contributes nothing
            continue
        keys |= set(option_map([parser, *subparsers_of(parser).values()]))
    return keys


def convert(action: argparse.Action, value: Any, source: str) -> Any:
    """Turn a file or environment value into what argparse would have stored for the flag."""
    option = action.option_strings[-1]

    def as_bool(v: Any) -> bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str):
            try:
                return parse_bool(v)
            except ValueError:
                pass
        raise SettingsError(f"{source}: {option} takes true or false, got {v!r}")

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return as_bool(value) if isinstance(action, argparse._StoreTrueAction) else not as_bool(value)
    if isinstance(action, argparse._StoreConstAction):
        return action.const if as_bool(value) else action.default
    if action.nargs not in (None, "?"):
        items = value if isinstance(value, list) else [s for s in str(value).replace(",", " ").split()]
        return [convert_one(action, item, source) for item in items]
    if isinstance(value, list):
        if action.type not in (None, str) or not all(isinstance(v, str) for v in value):
            raise SettingsError(f"{source}: {option} takes one value, got a list")
        value = ",".join(value)
    return convert_one(action, value, source)


def convert_one(action: argparse.Action, value: Any, source: str) -> Any:
    option = action.option_strings[-1]
    parse = action.type or str
    if isinstance(value, (dict, list)) or (isinstance(value, bool) and parse in (str, int, float)):
        raise SettingsError(f"{source}: {option} cannot take {value!r}")
    try:
        if isinstance(value, bool):  # a true/false flag (typed by parse_bool)
            result = parse(str(value).lower())
        elif parse is int and isinstance(value, float):
            raise ValueError("not an integer")
        else:
            result = parse(value if parse in (int, float) else str(value))
    except (ValueError, TypeError, argparse.ArgumentTypeError) as error:
        raise SettingsError(f"{source}: {option}: invalid value {value!r} ({error})") from None
    if action.choices is not None and result not in action.choices:
        raise SettingsError(f"{source}: {option}: {result!r} is not one of {sorted(action.choices)}")
    return result


def config_path_in(argv: list[str], environ: Mapping[str, str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return environ.get(ENV_PREFIX + "CONFIG") or None


def apply_sources(
    parsers: list[argparse.ArgumentParser],
    command_path: list[str],
    argv: list[str],
    environ: Mapping[str, str],
    commands: Mapping[str, tuple[str, str]],
) -> None:
    """Set file and environment values as defaults on `parsers` (the chosen command, then its nested
    subcommand, if any); raises SettingsError naming the key and its source."""
    options = option_map(parsers)
    values: dict[str, tuple[Any, str]] = {}
    path = config_path_in(argv, environ)
    if path:
        try:
            shared, own = flatten_file(load_file(path), command_path, commands)
        except SettingsError as error:
            raise SettingsError(str(error) if str(path) in str(error) else f"{path}: {error}") from None
        foreign = [k for k in shared if k not in options]
        if foreign:
            universe = all_command_keys(commands)
            unknown = [k for k in foreign if k not in universe]
            if unknown:
                raise SettingsError(
                    f"{path}: unknown key {unknown[0]!r}: no dilocox command has a flag "
                    f"--{unknown[0].replace('_', '-')}"
                )
        bad = [k for k in own if k not in options]
        if bad:
            where = ".".join(command_path)
            raise SettingsError(
                f"{path}: [{where}] has unknown key {bad[0]!r}: dilocox {' '.join(command_path)} has no flag "
                f"--{bad[0].replace('_', '-')}"
            )
        for key, value in {**shared, **own}.items():
            if key in options:
                values[key] = (value, f"{path}: key {key!r}")
    for key in options:
        name = env_name(key)
        if name in environ:
            values[key] = (environ[name], f"environment variable {name}")
    _refuse_unknown_variables(environ, options, commands)
    for key, (value, source) in values.items():
        parser, action = options[key]
        parser.set_defaults(**{action.dest: convert(action, value, source)})
        action.required = False
    if parsers:
        parsers[-1].set_defaults(_config_applied=True)


def _refuse_unknown_variables(
    environ: Mapping[str, str], options: Mapping[str, Any], commands: Mapping[str, tuple[str, str]]
) -> None:
    """A `DILOCOX_*` variable that no dilocox command has a flag for is a typo (`DILOCOX_INER_STEPS`), which
    would otherwise leave its setting at the default without a word: refused like a file's unknown key.
    Another command's flag is fine (one environment serves every process of a container)."""
    stray = [
        name
        for name in environ
        if name.startswith(ENV_PREFIX)
        and name not in OTHER_VARIABLES
        and key_of(name[len(ENV_PREFIX) :]) not in options
    ]
    if not stray:
        return
    universe = all_command_keys(commands)
    unknown = sorted(name for name in stray if key_of(name[len(ENV_PREFIX) :]) not in universe)
    if unknown:
        name = unknown[0]
        known = sorted({env_name(k) for k in universe} | OTHER_VARIABLES)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise SettingsError(
            f"environment variable {name}: no dilocox command has a flag "
            f"--{key_of(name[len(ENV_PREFIX) :]).replace('_', '-')}"
            f"{hint}; unset it, or see `dilocox <command> --help` for the DILOCOX_<FLAG> names"
        )


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` on a command that does not define one itself (RunConfig commands already do)."""
    if "--config" not in parser._option_string_actions:
        parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
