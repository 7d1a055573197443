"""The run configuration's command-line flags: one flag per leaf field of `RunConfig`, and back.

A flag is named after its field (`--rounds`, `--n-layer`; the other groups prefixed: `--inner-steps`,
`--outer-lr`, `--compress-codec`), typed like its default, with its line of help from field_help.py. From
here: the flags added to a command's parser, a `RunConfig` read back from parsed flags (defaults ← config
file ← explicit flags), the flags that reproduce a configuration for a child process, and the flags'
argparse destinations. Its own module because this is the command line's side of the configuration, which
run.py's dataclasses (what a run is, as the API's callers build it) do not need.
"""

from __future__ import annotations

import dataclasses

from dilocox.common.config.field_help import FIELD_HELP
from dilocox.common.config.run import RunConfig, from_dict
from dilocox.common.config.sources import CONFIG_HELP, GROUP_FLAG_PREFIXES, load_file, parse_bool


def _flag_fields(cls: type = RunConfig):
    """Yield (flag, dest, group or None, field) for every leaf field of RunConfig."""
    for f in dataclasses.fields(cls):
        if f.name in GROUP_FLAG_PREFIXES:
            sub = f.default_factory  # type: ignore[misc]
            for g in dataclasses.fields(sub):
                flag = "--" + GROUP_FLAG_PREFIXES[f.name] + g.name.replace("_", "-")
                yield flag, f"{f.name}__{g.name}", f.name, g
        else:
            yield "--" + f.name.replace("_", "-"), f.name, None, f


def add_config_arguments(parser, defaults: RunConfig | None = None) -> None:
    """Add one flag per config field; unset flags stay None so a config file's values win over defaults."""
    defaults = defaults or RunConfig()
    group = parser.add_argument_group("run configuration (also from a --config file or DILOCOX_<FLAG> variables)")
    group.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    for flag, dest, grp, f in _flag_fields():
        default = getattr(getattr(defaults, grp), f.name) if grp else getattr(defaults, f.name)
        add_field_argument(group, flag, dest, default)


def add_field_argument(group, flag: str, dest: str, default: object) -> None:
    """One flag for one config field, typed like its default; booleans take true/false."""
    kind = type(default)
    parse = parse_bool if kind is bool else kind
    what = FIELD_HELP.get(dest, "")
    metavar = "BOOL" if kind is bool else kind.__name__.upper()
    group.add_argument(
        flag, dest=dest, type=parse, default=None, metavar=metavar, help=f"{what} (default {default})".lstrip()
    )


def config_from_args(args, base: RunConfig | None = None) -> RunConfig:
    """Defaults ← config file ← explicit flags.

    Under the `dilocox` console script the file (and DILOCOX_* variables) have already become the
    flags' values (common/config/sources.py marks that with `_config_applied`); read directly only otherwise.
    """
    config = base or RunConfig()
    if getattr(args, "config", None) and not getattr(args, "_config_applied", False):
        config = from_dict(load_file(args.config), config)
    overrides: dict = {}
    for _flag, dest, grp, f in _flag_fields():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if grp:
            overrides.setdefault(grp, {})[f.name] = value
        else:
            overrides[f.name] = value
    return from_dict(overrides, config)


def flag_dests() -> set[str]:
    """The argparse destinations of every RunConfig flag (`add_config_arguments`)."""
    return {dest for _flag, dest, _grp, _f in _flag_fields()}


def config_flags(config: RunConfig) -> list[str]:
    """The command-line flags that reproduce `config` (used to hand a config to child processes)."""
    argv = []
    for flag, _dest, grp, f in _flag_fields():
        value = getattr(getattr(config, grp), f.name) if grp else getattr(config, f.name)
        argv += [flag, str(value)]
    return argv
