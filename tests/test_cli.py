"""The `dilocox` console script and the typed run configuration behind its flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from dilocox.common import cli
from dilocox.common.config.run import InnerConfig, ModelConfig, OuterConfig, RunConfig, WireConfig, as_dict, from_dict
from dilocox.common.config.run_flags import add_config_arguments, config_flags, config_from_args

SUBCOMMAND_FLAGS = {
    "server": ["--num-shards", "--shard-index"],
    "worker": ["--servers", "--inner-steps"],
    "sim": ["--clusters", "--shards"],
    "status": ["--servers"],
}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dilocox.common.cli", *args]


# --------------------------------------------------------------------------- processes (started together)


@pytest.fixture(scope="module")
def cli_runs():
    """Run the subprocess cases concurrently (each pays the torch/grpc import), keyed by name."""
    cases = {
        "help": _cli("--help"),
        "worker_bad_index": _cli(
            "worker", "--cluster-index", "5", "--num-clusters", "2", "--servers", "127.0.0.1:1", "--insecure"
        ),
        "server_bad_index": _cli("server", "--shard-index", "3", "--num-shards", "2", "--port", "0", "--insecure"),
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        name: subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL
        )
        for name, argv in cases.items()
    }
    results = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=60)  # a hang fails the test instead of blocking the suite
            results[name] = subprocess.CompletedProcess(cases[name], proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_top_level_help_lists_subcommands(cli_runs):
    run = cli_runs["help"]
    assert run.returncode == 0, run.stderr
    assert "usage: dilocox" in run.stdout
    for name in SUBCOMMAND_FLAGS:
        assert name in run.stdout


def test_worker_with_cluster_index_out_of_range_fails_clearly(cli_runs):
    run = cli_runs["worker_bad_index"]
    assert run.returncode != 0
    assert "--cluster-index 5" in run.stderr and "[0, 2)" in run.stderr
    assert "Traceback" not in run.stderr


def test_server_with_shard_index_out_of_range_fails_clearly(cli_runs):
    run = cli_runs["server_bad_index"]
    assert run.returncode != 0
    assert "dilocox server" in run.stderr and "shard_index 3" in run.stderr and "[0, 2)" in run.stderr
    assert "Traceback" not in run.stderr


# --------------------------------------------------------------------------- parser, in process


@pytest.mark.parametrize("command", sorted(SUBCOMMAND_FLAGS))
def test_subcommand_help_exits_zero_and_names_key_flags(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: dilocox {command}" in out
    for flag in SUBCOMMAND_FLAGS[command]:
        assert flag in out


def test_no_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "command" in capsys.readouterr().err


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["frobnicate"])
    assert info.value.code == 2
    assert "frobnicate" in capsys.readouterr().err


def test_worker_requires_servers(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["worker"])
    assert info.value.code == 2
    assert "--servers" in capsys.readouterr().err


def test_bad_flag_type_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["worker", "--servers", "127.0.0.1:1", "--inner-steps", "many"])
    assert info.value.code == 2
    assert "--inner-steps" in capsys.readouterr().err


def test_only_the_chosen_subcommand_module_is_wired():
    parser = cli.build_parser(["sim"])
    args = parser.parse_args(["sim", "--clusters", "3"])
    assert args._module == "dilocox.sim.main" and args.clusters == 3


# --------------------------------------------------------------------------- config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return parser


CUSTOM = RunConfig(
    run_id="run with spaces",
    rounds=3,
    seed=9,
    eval_batches=2,
    model=ModelConfig(block_size=32, n_layer=3, n_head=2, n_embd=64, dropout=0.1),
    inner=InnerConfig(steps=7, batch_size=4, lr=1.5e-4, weight_decay=0.0, warmup_steps=0),
    outer=OuterConfig(lr=0.35, momentum=0.8),
    wire=WireConfig(chunk_bytes=12345, zstd_level=3),
)


@pytest.mark.parametrize("config", [RunConfig(), CUSTOM], ids=["defaults", "custom"])
def test_config_flags_round_trip(config):
    argv = config_flags(config)
    assert "--inner-steps" in argv and "--outer-lr" in argv and "--wire-chunk-bytes" in argv and "--n-layer" in argv
    back = config_from_args(_parser().parse_args(argv))
    assert back == config


def test_every_field_has_a_flag():
    flags = set(config_flags(RunConfig())[::2])
    leaves = 0
    for f in dataclasses.fields(RunConfig):
        value = getattr(RunConfig(), f.name)
        leaves += len(dataclasses.fields(value)) if dataclasses.is_dataclass(value) else 1
    assert len(flags) == leaves


def test_no_flags_gives_defaults():
    assert config_from_args(_parser().parse_args([])) == RunConfig()


def test_toml_file_applies_and_flags_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'run_id = "from-file"\nrounds = 5\n[model]\nn_layer = 3\n[inner]\nsteps = 11\nlr = 0.01\n[outer]\nlr = 0.3\n'
    )
    args = _parser().parse_args(["--config", str(path), "--inner-steps", "22", "--rounds", "6"])
    config = config_from_args(args)
    assert config.run_id == "from-file"
    assert config.model.n_layer == 3
    assert config.inner.lr == 0.01 and config.outer.lr == 0.3  # from the file
    assert config.inner.steps == 22 and config.rounds == 6  # flags win over the file
    assert config.inner.batch_size == InnerConfig().batch_size  # untouched: defaults
    assert config.wire == WireConfig()


def test_json_file_applies(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"seed": 77, "wire": {"zstd_level": 5}}))
    config = config_from_args(_parser().parse_args(["--config", str(path)]))
    assert config.seed == 77 and config.wire.zstd_level == 5


def test_as_dict_round_trips_through_from_dict():
    data = json.loads(json.dumps(as_dict(CUSTOM)))
    assert from_dict(data) == CUSTOM


@pytest.mark.parametrize(
    "data, key",
    [({"roundz": 3}, "roundz"), ({"inner": {"stepz": 3}}, "stepz"), ({"wire": {"chunk": 1}}, "chunk")],
)
def test_unknown_keys_raise_with_the_key(data, key):
    with pytest.raises(ValueError, match=key):
        from_dict(data)


def test_unknown_key_in_config_file_raises(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[outer]\nmomentun = 0.5\n")
    with pytest.raises(ValueError, match="momentun"):
        config_from_args(_parser().parse_args(["--config", str(path)]))


def test_missing_config_file_raises(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        config_from_args(_parser().parse_args(["--config", str(tmp_path / "nope.toml")]))


@pytest.mark.parametrize(
    "data",
    [
        {"outer": {"lr": -1.0}},
        {"outer": {"momentum": 1.0}},
        {"model": {"n_embd": 130, "n_head": 4}},
        {"model": {"n_layer": 0}},
    ],
)
def test_invalid_values_raise(data):
    with pytest.raises(ValueError):
        from_dict(data)


def test_every_flag_of_every_command_says_what_it_does():
    """No `--help` line is only a type and a default (the run configuration's ~55 flags
    take theirs from common/config/field_help.py); every command's help renders."""
    from dilocox.common.config.field_help import FIELD_HELP
    from dilocox.common.config.run_flags import flag_dests
    from dilocox.common.config.sources import subparsers_of

    assert set(FIELD_HELP) == flag_dests()
    bare = []
    for name in cli.SUBCOMMANDS:
        top = subparsers_of(cli.build_parser([name]))[name]
        for label, parser in [(name, top), *((f"{name} {k}", p) for k, p in subparsers_of(top).items())]:
            parser.format_help()
            for action in parser._actions:
                if action.option_strings and not isinstance(action, argparse._HelpAction):
                    text = (action.help or "").strip()
                    if not text or text.startswith("(default"):
                        bare.append(f"{label} {action.option_strings[0]}")
    assert bare == []


def test_every_model_a_help_text_names_exists():
    """An example in `--help` is copied as written: `deploy --worker-flags`' example named `--model llama`, which
    every worker refused as an unknown model. Each `--model X` in any command's help must resolve."""
    import re

    from dilocox.common.config.cli_reference import command_parsers
    from dilocox.worker.models.spec import ModelSpecError, resolve_model

    named = {
        (prog, model)
        for prog, parser, _ in command_parsers()
        for model in re.findall(r"--model ([a-z0-9][\w.-]*)(?![\w.:-])", parser.format_help())
    }
    assert named, "no help text names a model: the pattern no longer matches how examples are written"
    for prog, model in sorted(named):
        try:
            resolve_model(model)
        except ModelSpecError as error:
            pytest.fail(f"`{prog} --help` names a model no worker accepts: {error}")
