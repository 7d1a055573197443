"""Flag values from --config files and DILOCOX_<FLAG> variables: precedence, tables, errors, `config show`."""

from __future__ import annotations

import tomllib

import pytest

from dilocox.common import cli
from dilocox.common.config.run import InnerConfig, RunConfig, from_dict
from dilocox.common.config.run_flags import config_from_args
from dilocox.common.config.sources import env_name

RUN_TOML = """
run_id = "from-file"
port = 7001
servers = ["a:1", "b:2"]
rounds = 5
insecure = true

[model]
n_layer = 3

[inner]
steps = 30
lr = 0.01

[server]
port = 7002
metrics-port = 9100

[worker]
cluster = "site-a"
"""


def parse(argv: list[str], environ: dict[str, str] | None = None):
    return cli.build_parser(argv, environ or {}).parse_args(argv)


@pytest.fixture
def run_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML)
    return str(path)


def test_precedence_flag_over_env_over_file_over_default(run_toml):
    assert parse(["server", "--insecure"]).port == 50051  # default
    assert parse(["server", "--config", run_toml]).port == 7002  # file: [server] beats the top level
    assert parse(["server", "--config", run_toml], {"DILOCOX_PORT": "7003"}).port == 7003  # env beats file
    assert (
        parse(["server", "--config", run_toml, "--port", "7004"], {"DILOCOX_PORT": "7003"}).port == 7004
    )  # flag beats all

    def steps(argv, environ=None):
        return config_from_args(parse(["worker", *argv], environ)).inner.steps

    assert steps(["--servers", "x:1"]) == InnerConfig().steps
    assert steps(["--config", run_toml]) == 30
    assert steps(["--config", run_toml], {"DILOCOX_INNER_STEPS": "40"}) == 40
    assert steps(["--config", run_toml, "--inner-steps", "50"], {"DILOCOX_INNER_STEPS": "40"}) == 50


def test_shared_file_gives_each_command_its_keys(run_toml):
    server = parse(["server", "--config", run_toml])
    assert (server.run_id, server.metrics_port, server.insecure) == ("from-file", 9100, True)
    assert not hasattr(server, "servers") and not hasattr(server, "cluster")  # other commands' keys: ignored
    worker = parse(["worker", "--config", run_toml])  # --servers is required, and the file gives it
    assert (worker.servers, worker.cluster, worker.metrics_port) == ("a:1,b:2", "site-a", 0)
    config = config_from_args(worker)
    assert (config.run_id, config.rounds, config.model.n_layer, config.inner.lr) == ("from-file", 5, 3, 0.01)


def test_environment_alone_configures_a_command():
    """What docker-compose does: no file, no flags beyond the command, everything from `environment:`."""
    environ = {
        "DILOCOX_SERVERS": "shard-0:50051,shard-1:50051",
        "DILOCOX_RUN_ID": "compose",
        "DILOCOX_INSECURE": "1",
        "DILOCOX_N_LAYER": "4",
        "DILOCOX_INNER_ADAPTIVE_STEPS": "yes",
        "DILOCOX_METRICS_PORT": "9100",
        "DILOCOX_IMAGE": "ignored: no such flag",
    }
    args = parse(["worker"], environ)
    assert (args.servers, args.insecure, args.metrics_port) == ("shard-0:50051,shard-1:50051", True, 9100)
    config = config_from_args(args)
    assert (config.run_id, config.model.n_layer, config.inner.adaptive_steps) == ("compose", 4, True)
    assert env_name("--inner-steps") == "DILOCOX_INNER_STEPS" and env_name("--run-id") == "DILOCOX_RUN_ID"


def test_config_file_named_by_environment(run_toml):
    assert parse(["server"], {"DILOCOX_CONFIG": run_toml}).port == 7002


@pytest.mark.parametrize(
    "text, message",
    [
        ("inner_stpes = 3\n", "unknown key 'inner_stpes': no dilocox command has a flag --inner-stpes"),
        (
            "[worker]\nnum_shards = 3\n",
            "[worker] has unknown key 'num_shards': dilocox worker has no flag --num-shards",
        ),
        ("[inner]\nstpes = 3\n", "unknown key 'inner_stpes'"),
        ("[frobnicate]\nx = 1\n", "unknown table [frobnicate]"),
        ("rounds = 'many'\n", "key 'rounds': --rounds: invalid value 'many'"),
        ("log_format = 'xml'\n", "--log-format: 'xml' is not one of ['json', 'kv']"),
        ("rounds = [\n", "is not valid TOML"),
    ],
)
def test_bad_config_file_is_a_clear_error(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        parse(["worker", "--servers", "x:1", "--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err


def test_bad_environment_value_names_the_variable(capsys):
    with pytest.raises(SystemExit):
        parse(["server", "--insecure"], {"DILOCOX_PORT": "fifty"})
    assert "environment variable DILOCOX_PORT: --port: invalid value 'fifty'" in capsys.readouterr().err


def test_a_mistyped_environment_variable_is_an_error_naming_the_right_one(capsys):
    """A typo must not leave a setting at its default in silence; another command's flag (one environment
    serves a container's every process) and the non-flag variables stay fine."""
    with pytest.raises(SystemExit):
        parse(["worker"], {"DILOCOX_INER_STEPS": "3"})
    err = capsys.readouterr().err
    assert "environment variable DILOCOX_INER_STEPS: no dilocox command has a flag --iner-steps" in err
    assert "did you mean DILOCOX_INNER_STEPS?" in err
    shared = {
        "DILOCOX_SERVERS": "a:1",
        "DILOCOX_CACHE_DIR": "/tmp/c",
        "DILOCOX_IMAGE": "dilocox:cpu",
        "DILOCOX_ROUND_DEADLINE_S": "60",
    }
    assert (
        parse(["server", "--insecure"], shared).round_deadline_s == 60
    )  # the worker's --servers is not the server's: ignored


def test_config_show_prints_toml_that_reads_back(tmp_path, capsys, run_toml):
    argv = ["config", "show", "--config", run_toml, "--rounds", "7", "--compress-codec", "int8", "--dropout", "0.125"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    shown = from_dict(tomllib.loads(text))
    expected = config_from_args(
        parse(["worker", "--config", run_toml, "--rounds", "7", "--compress-codec", "int8", "--dropout", "0.125"])
    )
    assert shown == expected and shown != RunConfig()
    assert (shown.rounds, shown.run_id, shown.model.n_layer, shown.compress.codec) == (7, "from-file", 3, "int8")
    again = tmp_path / "shown.toml"
    again.write_text(text)
    assert cli.main(["config", "show", "--config", str(again)]) == 0  # the output is itself a --config file
    assert capsys.readouterr().out == text


def test_config_show_for_a_command_applies_its_own_table_and_environment(tmp_path, capsys, monkeypatch):
    """`config show --command worker` prints what `dilocox worker` would run with: the [worker] table's
    pp = 2 wins over the top level's (it printed pp = 1 before), env beats the file, the token is hidden."""
    path = tmp_path / "run.toml"
    path.write_text(
        'run_id = "shared"\npp = 1\n[inner]\nsteps = 7\n[worker]\npp = 2\nservers = "a:1,b:2"\n[server]\nnum-shards = '
        "3\n"
    )
    monkeypatch.setenv("DILOCOX_ROUNDS", "9")
    monkeypatch.setenv("DILOCOX_TOKEN", "s3cret")
    assert cli.main(["config", "show", "--command", "worker", "--config", str(path)]) == 0
    text = capsys.readouterr().out
    shown = tomllib.loads(text)
    assert (
        shown["parallel"]["pp"] == 2
        and shown["rounds"] == 9
        and shown["inner"]["steps"] == 7
        and shown["run_id"] == "shared"
    )
    assert shown["worker"]["servers"] == "a:1,b:2" and "s3cret" not in text and "# token: set (not printed)" in text
    assert cli.main(["config", "show", "--command", "server", "--config", str(path)]) == 0
    server = tomllib.loads(capsys.readouterr().out)
    assert server["server"]["num-shards"] == 3 and "parallel" not in server


def test_config_show_leaves_out_the_gpt_shape_for_a_hugging_face_model(capsys):
    """A preset or config.json has its own shape; n_layer & co. would only mislead."""
    assert cli.main(["config", "show", "--model", "llama-tiny", "--n-layer", "9"]) == 0
    text = capsys.readouterr().out
    model = tomllib.loads(text)["model"]
    assert (
        model["model"] == "llama-tiny"
        and "block_size" in model
        and "n_layer" not in model
        and "vocab_size" not in model
    )
    assert from_dict(tomllib.loads(text)).model.model == "llama-tiny"  # still a --config file
    assert cli.main(["config", "show", "--model", "gpt", "--n-layer", "9"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["model"]["n_layer"] == 9
