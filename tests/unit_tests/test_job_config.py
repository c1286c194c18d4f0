"""Tests for torchtitan.config: defaults, TOML, CLI syntax, errors, help, TOML export."""

import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from torchtitan.config import ConfigError, ConfigManager, JobConfig, last_wins, to_toml
from torchtitan.config.job_config import Training

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv):
    return ConfigManager().parse_args(list(argv))


def write(tmp_path, text, name="cfg.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults():
    cfg = parse()
    assert cfg == JobConfig()
    assert cfg.training.seq_len == 2048 and cfg.training.global_batch_size == -1
    assert cfg.optimizer.lr == 8e-4 and cfg.optimizer.implementation == "fused"
    assert cfg.compile.components == ["model", "loss"]
    assert cfg.to_dict()["parallelism"]["data_parallel_shard_degree"] == -1


def test_toml_load_and_precedence(tmp_path):
    path = write(
        tmp_path,
        "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1\n"
        '[compile]\ncomponents = ["model"]\n',
    )
    cfg = parse("--job.config_file", path, "--training.steps", "9")
    assert cfg.job.config_file == path
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.compile.components == ["model"]
    assert cfg.training.local_batch_size == 8  # default
    # Hyphenated, `=` form of the config-file flag, given after the override.
    assert parse("--training.steps=9", f"--job.config-file={path}").training.steps == 9


def test_equals_space_and_hyphen_forms():
    for argv in (
        ["--lr_scheduler.warmup_steps", "2"],
        ["--lr-scheduler.warmup-steps=2"],
        ["--lr-scheduler.warmup_steps", "2"],
    ):
        assert parse(*argv).lr_scheduler.warmup_steps == 2
    assert parse("--training.global_batch_size", "-1").training.global_batch_size == -1
    assert parse("--optimizer.implementation=for-loop").optimizer.implementation == "for-loop"


def test_bool_flags():
    assert parse("--training.deterministic").training.deterministic is True
    assert parse("--training.deterministic=false").training.deterministic is False
    assert parse("--training.deterministic", "true").training.deterministic is True
    assert (
        parse("--checkpoint.no_initial_load_model_only").checkpoint.initial_load_model_only is False
    )
    assert (
        parse("--checkpoint.no-initial-load-model-only").checkpoint.initial_load_model_only is False
    )


def test_an_option_given_twice_is_refused_and_last_wins_merges():
    with pytest.raises(
        ConfigError,
        match=r"^--training\.no_deterministic: training\.deterministic "
        r"is set twice on the command line \(first by --training\.deterministic\)",
    ):
        parse("--training.deterministic", "--training.no_deterministic")
    with pytest.raises(ConfigError, match="training.steps is set twice"):
        parse("--training.steps", "3", "--training.steps=4")
    merged = last_wins(
        [
            "--training.steps",
            "10",
            "--training.deterministic",
            "--job.dump_folder",
            "a",
            "--training.steps=2",
            "--training.no_deterministic",
        ]
    )
    assert merged == ["--job.dump_folder", "a", "--training.steps=2", "--training.no_deterministic"]
    assert parse(*merged).training.steps == 2


def test_list_and_none():
    assert parse("--compile.components", "model, loss").compile.components == ["model", "loss"]
    assert parse("--compile.components=model").compile.components == ["model"]
    assert parse("--compile.components=").compile.components == []
    cfg = parse("--training.seed", "3", "--lr_scheduler.decay_ratio", "0.2")
    assert cfg.training.seed == 3 and cfg.lr_scheduler.decay_ratio == 0.2
    cfg = parse("--training.seed", "none")
    assert cfg.training.seed is None


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (
            ["--trainig.steps", "1"],
            r"--trainig\.steps: unknown section 'trainig'; did you mean "
            r"'training'\?",
        ),
        (
            ["--training.stepz", "1"],
            r"--training\.stepz: unknown key 'stepz' in section "
            r"\[training\]; did you mean 'steps'\?",
        ),
        (["--training.steps", "abc"], r"^--training\.steps: expected an integer, got 'abc'$"),
        (["--optimizer.lr=fast"], r"--optimizer\.lr: expected a number, got 'fast'"),
        (
            ["--training.deterministic=maybe"],
            r"--training\.deterministic: expected a boolean "
            r"\(true/false\), got 'maybe'",
        ),
        (
            ["--optimizer.name", "SGD"],
            r"--optimizer\.name: invalid choice 'SGD'; allowed: "
            r"'AdamW', 'Adam'",
        ),
        (["--training.steps"], r"--training\.steps: missing value \(expected INT\)"),
        (["--training.steps", "--training.seq_len", "4"], r"--training\.steps: missing value"),
        (["--training.seed", "x"], r"--training\.seed: expected an integer, got 'x'"),
        (["--training"], r"--training: 'training' is a section"),
        (["steps"], r"unexpected argument 'steps'"),
        (["--training.no_steps"], r"unknown key 'no_steps' in section \[training\]"),
        (["--training.no_deterministic=1"], r"negated flag takes no value"),
        (["--job.config_file"], r"--job\.config_file: missing value"),
    ],
)
def test_cli_errors(argv, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        parse(*argv)
    assert "\n" not in str(err.value)


def test_toml_errors(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"TOML file not found: .*nope\.toml"):
        parse("--job.config_file", missing)
    cases = [
        ("[training\nsteps = 1\n", r"cfg\.toml: not a valid TOML file"),
        (
            "[trainig]\nsteps = 1\n",
            r"cfg\.toml: trainig: unknown section 'trainig'; did you "
            r"mean 'training'\?",
        ),
        (
            "[training]\nstepz = 1\n",
            r"cfg\.toml: training\.stepz: unknown key 'stepz' in "
            r"section \[training\]; did you mean 'steps'\?",
        ),
        (
            '[training]\nsteps = "abc"\n',
            r"cfg\.toml: training\.steps: expected an integer, "
            r"got 'abc' \(str\)",
        ),
        ("[training]\ndeterministic = 1\n", r"training\.deterministic: expected a boolean"),
        ("[training]\ndataset = 3\n", r"training\.dataset: expected a string, got 3 \(int\)"),
        (
            '[optimizer]\nname = "SGD"\n',
            r"optimizer\.name: invalid choice 'SGD'; allowed: "
            r"'AdamW', 'Adam'",
        ),
        ("training = 3\n", r"training: expected a \[training\] table"),
    ]
    for text, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as err:
            parse("--job.config_file", write(tmp_path, text))
        assert "\n" not in str(err.value)


def test_cli_error_exits_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.config", "--training.steps", "abc"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: --training.steps: expected an integer, got 'abc'"]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--help")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "[training]" in out and "--training.seq_len INT  (default: 2048)" in out
    assert "Tokens per training sequence." in out
    assert "--optimizer.name {AdamW,Adam}" in out
    assert "--training.deterministic, --training.no_deterministic" in out


def test_to_toml_round_trip(tmp_path):
    cfg = parse(
        "--training.steps",
        "5",
        "--training.seed",
        "7",
        "--optimizer.eps",
        "1e-12",
        "--job.description",
        'quote " and \\ backslash\ttab',
        "--compile.components",
        "loss",
        "--lr_scheduler.decay_ratio",
        "0.25",
        "--checkpoint.no_initial_load_model_only",
    )
    text = to_toml(cfg)
    again = parse("--job.config_file", write(tmp_path, text, "resolved.toml"))
    assert dataclasses.replace(again, job=dataclasses.replace(again.job, config_file=None)) == cfg
    assert (
        to_toml(again).replace(f"# config_file: {again.job.config_file}", "# config_file: none")
        == text
    )


@dataclass
class Extra:
    """An extension section."""

    knob: int = 3
    """A knob only the extension knows."""

    mode: str | None = None
    """Optional mode."""


@dataclass
class ExtendedTraining(Training):
    extra_flag: bool = False
    """Added to an existing section by subclassing."""


@dataclass
class ExtendedConfig(JobConfig):
    extra: Extra = field(default_factory=Extra)
    training: ExtendedTraining = field(default_factory=ExtendedTraining)


def test_custom_root_dataclass(tmp_path, capsys):
    manager = ConfigManager(config_cls=ExtendedConfig)
    path = write(tmp_path, "[extra]\nknob = 4\n[training]\nextra_flag = true\n")
    cfg = manager.parse_args(
        ["--job.config_file", path, "--extra.mode", "fast", "--training.steps", "2"]
    )
    assert isinstance(cfg, ExtendedConfig)
    assert (cfg.extra.knob, cfg.extra.mode, cfg.training.extra_flag) == (4, "fast", True)
    assert cfg.training.steps == 2
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'knop' in section \[extra\]; did you "
        r"mean 'knob'\?",
    ):
        manager.parse_args(["--extra.knop", "1"])
    with pytest.raises(SystemExit):
        manager.parse_args(["-h"])
    out = capsys.readouterr().out
    assert "A knob only the extension knows." in out
    assert "Added to an existing section by subclassing." in out
    assert "Tokens per training sequence." in out  # inherited docstrings survive
    assert (
        ConfigManager(ExtendedConfig)
        .parse_args(["--job.config_file", write(tmp_path, to_toml(cfg), "ext.toml")])
        .extra.mode
        == "fast"
    )


AP_CONFIG = "torchtitan.experiments.auto_parallel.job_config"


def test_custom_config_module_adds_its_section_from_cli_or_toml(tmp_path, capsys):
    cfg = parse("--job.custom_config_module", AP_CONFIG, "--autoparallel.memory_budget_gib", "12")
    assert cfg.autoparallel.memory_budget_gib == 12.0 and cfg.autoparallel.cost_model == "auto"
    assert cfg.training.steps == JobConfig().training.steps  # the core sections stay
    path = tmp_path / "ap.toml"
    path.write_text(
        f'[job]\ncustom_config_module = "{AP_CONFIG}"\n[autoparallel]\nplan_cache = false\n'
    )
    cfg = parse("--job.config_file", str(path), "--autoparallel.cost_model", "h100")
    assert cfg.autoparallel.plan_cache is False and cfg.autoparallel.cost_model == "h100"
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert parse("--job.config_file", str(again)).autoparallel == cfg.autoparallel
    with pytest.raises(SystemExit):
        parse("--job.custom_config_module", AP_CONFIG, "--help")
    assert "--autoparallel.solver_time_limit_seconds FLOAT  (default: 300.0)" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (
            ["--autoparallel.cost_model", "h100"],
            r"unknown section 'autoparallel'; .*needs --job\.custom_config_module",
        ),
        (
            ["--job.custom_config_module", "no.such.module"],
            r"^--job\.custom_config_module: cannot import 'no\.such\.module'",
        ),
        (
            ["--job.custom_config_module", "torchtitan.config.job_config"],
            r"torchtitan\.config\.job_config\.JobConfig redefines section 'activation_checkpoint'",
        ),
    ],
)
def test_custom_config_module_errors(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse(*argv)


def test_an_experiment_section_validates_itself():
    from torchtitan.config.validate import validate_job_config

    for option, value, pattern in [
        ("cost_model", "tpu9", r"unknown device 'tpu9'; choose auto or one of .*h100"),
        ("memory_budget_gib", "0", r"memory_budget_gib: must be a positive number, got 0\.0"),
        ("solver_time_limit_seconds", "nan", r"must be a positive number, got nan"),
        ("solver_proof_limit_seconds", "-1", r"proof_limit_seconds: must be a positive number"),
    ]:
        cfg = parse(
            "--job.custom_config_module",
            AP_CONFIG,
            f"--autoparallel.{option}",
            value,
            "--lr_scheduler.warmup_steps",
            "2",
        )
        with pytest.raises(ConfigError, match=pattern):
            validate_job_config(cfg)
