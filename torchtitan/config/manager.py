"""Build a `JobConfig` from dataclass defaults, a TOML file and the command line.

Precedence: dataclass defaults < `--job.config_file` TOML < command-line options.

Command-line syntax (section and key may use `-` or `_`):
  --section.key value      --section.key=value
  --section.flag           --section.no_flag       --section.flag=false
  --section.items a,b,c    (list fields)           --section.opt none   (Optional fields)

The parser walks any dataclass tree (`ConfigManager(config_cls=...)`), so
adding a field or a section dataclass is all an extension needs. Every bad
input raises `ConfigError` with a one-line message naming the key, the value
and what is allowed.
"""

import ast
import dataclasses
import difflib
import functools
import importlib
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Hashable
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import UserInputError

CONFIG_FILE_KEY = ("job", "config_file")
CUSTOM_CONFIG_KEY = ("job", "custom_config_module")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


class ConfigError(UserInputError):
    """Invalid configuration input; the message is a single line meant for the user."""


class _BadValue(Exception):
    """Raised by `_convert`; the caller prefixes the key to make a ConfigError."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the string literal written right below it in the class body."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue  # builtins, classes made at runtime, ...
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return _cached_hints(cls)


@functools.cache
def _cached_hints(cls: Hashable) -> dict[str, Any]:
    # a plain wrapper: mypy takes `type[Any]` for unhashable (python/mypy#11470)
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), True  # noqa: UP007
    return tp, False


def _convert(tp: Any, raw: Any, from_cli: bool) -> Any:
    """Turn a CLI string (from_cli) or a TOML value into a value of type `tp`."""
    base, optional = _strip_optional(tp)
    if optional and isinstance(raw, str) and raw.lower() == "none":
        return None
    got = f"got {raw!r}" if from_cli else f"got {raw!r} ({type(raw).__name__})"
    origin = typing.get_origin(base)
    if origin in (typing.Union, types.UnionType):  # e.g. int | Literal["auto"]: first that fits
        for member in typing.get_args(base):
            try:
                return _convert(member, raw, from_cli)
            except _BadValue:
                pass
        raise _BadValue(f"expected {_type_label(base).lower()}, {got}")
    if origin is Literal:
        choices = typing.get_args(base)
        for choice in choices:
            if type(raw) is type(choice) and raw == choice:
                return choice
            if from_cli and str(choice) == raw:
                return choice
        allowed = ", ".join(repr(c) for c in choices)
        raise _BadValue(f"invalid choice {raw!r}; allowed: {allowed}")
    if origin is list:
        (item_tp,) = typing.get_args(base) or (str,)
        if isinstance(raw, str):  # comma-separated, also accepted in TOML
            return [_convert(item_tp, s.strip(), True) for s in raw.split(",") if s.strip()]
        if isinstance(raw, list) and not from_cli:
            return [_convert(item_tp, x, False) for x in raw]
        raise _BadValue(f"expected a list, {got}")
    if base is bool:
        if isinstance(raw, bool):
            return raw
        if from_cli and raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
        raise _BadValue(f"expected a boolean (true/false), {got}")
    if base is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if from_cli:
            try:
                return int(raw)
            except ValueError:
                pass
        raise _BadValue(f"expected an integer, {got}")
    if base is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if from_cli:
            try:
                return float(raw)
            except ValueError:
                pass
        raise _BadValue(f"expected a number, {got}")
    if base is str:
        if isinstance(raw, str):
            return raw
        raise _BadValue(f"expected a string, {got}")
    raise TypeError(f"unsupported config field type {tp!r}")


def _unknown(cls: type, parents: list[str], name: str, where: str) -> ConfigError:
    """Error for a name that is not a field of `cls`, suggesting the closest one."""
    names = list(_fields(cls))
    what = (
        f"unknown key {name!r} in section [{'.'.join(parents)}]"
        if parents
        else (f"unknown section {name!r}")
    )
    close = difflib.get_close_matches(name.replace("-", "_"), names, n=1)
    hint = f"did you mean {close[0]!r}?" if close else "allowed: " + ", ".join(names)
    if not parents:
        hint += " (an experiment's own section needs --job.custom_config_module)"
    return ConfigError(f"{where}: {what}; {hint}")


def _type_label(tp: Any) -> str:
    base, optional = _strip_optional(tp)
    origin = typing.get_origin(base)
    if origin in (typing.Union, types.UnionType):
        label = "|".join(_type_label(member) for member in typing.get_args(base))
    elif origin is Literal:
        label = "{" + ",".join(str(c) for c in typing.get_args(base)) + "}"
    elif origin is list:
        label = _type_label((typing.get_args(base) or (str,))[0]) + "[,...]"
    else:
        label = getattr(base, "__name__", str(base)).upper()
    return label + "|none" if optional else label


def _scan_option(argv: list[str], key: tuple[str, str], what: str) -> str | None:
    """Find `--job.config_file X` / `--job.config-file=X` (or another `key`) before full
    parsing; the last one wins ('none' is None)."""
    path = None
    for i, tok in enumerate(argv):
        name, eq, value = tok.partition("=")
        if name.replace("-", "_") != "__" + ".".join(key):
            continue
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"{name}: missing value (expected a {what})")
            value = argv[i + 1]
        path = None if value.lower() == "none" else value
    return path


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--job.config_file: TOML file not found: {path!r}") from None
    except OSError as e:
        raise ConfigError(f"--job.config_file: cannot read {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        msg = str(e).replace("\n", " ")
        raise ConfigError(f"{path}: not a valid TOML file: {msg}") from None


def extend_config_class(base: type, module_name: str) -> type:
    """`base` plus the sections of the `JobConfig` dataclass in module `module_name` (an
    experiment's own options, e.g. the planner's `[autoparallel]`); its sections must be
    new, not redefine `base`'s."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"--job.custom_config_module: cannot import {module_name!r} ({e}); give a module "
            "importable from the working directory or PYTHONPATH"
        ) from None
    extra = getattr(module, "JobConfig", None)
    if not (isinstance(extra, type) and dataclasses.is_dataclass(extra)):
        raise ConfigError(
            f"--job.custom_config_module: {module_name} defines no JobConfig dataclass"
        )
    clash = sorted(set(_fields(extra)) & set(_fields(base)))
    if clash:
        raise ConfigError(
            f"--job.custom_config_module: {module_name}.JobConfig redefines section {clash[0]!r}"
        )
    return dataclasses.make_dataclass(base.__name__, [], bases=(extra, base))


class ConfigManager:
    """Parses configs for the dataclass tree rooted at `config_cls`."""

    def __init__(self, config_cls: type = JobConfig):
        self.config_cls = config_cls

    def parse_args(self, argv: list[str] | None = None) -> Any:
        """Return defaults < TOML (`--job.config_file`) < CLI. `-h/--help` prints help, exits 0."""
        argv = list(sys.argv[1:] if argv is None else argv)
        path = _scan_option(argv, CONFIG_FILE_KEY, "path to a TOML file")
        table = _read_toml(path) if path is not None else {}
        job = table.get("job")
        job_table: dict = job if isinstance(job, dict) else {}
        module = _scan_option(argv, CUSTOM_CONFIG_KEY, "module name") or job_table.get(
            CUSTOM_CONFIG_KEY[1]
        )
        cls = self.config_cls
        if isinstance(module, str) and module:
            cls = extend_config_class(cls, module)
        config = cls()
        if path is not None:
            self._apply_table(config, table, [], path)
        if "-h" in argv or "--help" in argv:
            print(self.help_text(config))
            sys.exit(0)
        self._apply_cli(config, argv)
        return config

    def load_toml(self, config: Any, path: str) -> None:
        """Apply the settings of TOML file `path` onto `config` in place."""
        self._apply_table(config, _read_toml(path), [], path)

    def _apply_table(self, obj: Any, table: dict, parents: list[str], path: str) -> None:
        cls = type(obj)
        for key, raw in table.items():
            name = key.replace("-", "_")
            dotted = ".".join(parents + [key])
            where = f"{path}: {dotted}"
            if name not in _fields(cls):
                raise _unknown(cls, parents, key, where)
            tp = _hints(cls)[name]
            if _is_section(tp):
                if not isinstance(raw, dict):
                    raise ConfigError(f"{where}: expected a [{dotted}] table, got {raw!r}")
                self._apply_table(getattr(obj, name), raw, parents + [name], path)
                continue
            if isinstance(raw, dict):
                raise ConfigError(f"{where}: is a key, not a section; got a table")
            try:
                setattr(obj, name, _convert(tp, raw, from_cli=False))
            except _BadValue as e:
                raise ConfigError(f"{where}: {e}") from None

    def _apply_cli(self, config: Any, argv: list[str]) -> None:
        given: dict[str, str] = {}  # dotted key -> the option that set it
        i = 0
        while i < len(argv):
            tok = argv[i]
            i += 1
            if not tok.startswith("--") or len(tok) == 2:
                raise ConfigError(
                    f"unexpected argument {tok!r}; options look like --section.key value"
                )
            opt, eq, value = tok.partition("=")
            parts = opt[2:].replace("-", "_").split(".")
            obj: Any = config
            parents: list[str] = []
            for part in parts[:-1]:  # walk down to the section holding the key
                cls = type(obj)
                if part not in _fields(cls):
                    raise _unknown(cls, parents, part, opt)
                if not _is_section(_hints(cls)[part]):
                    raise ConfigError(
                        f"{opt}: {'.'.join(parents + [part])!r} is a key, not a section"
                    )
                obj, parents = getattr(obj, part), parents + [part]
            cls, key, negate = type(obj), parts[-1], False
            if key not in _fields(cls) and key.startswith("no_"):
                inner = _hints(cls).get(key[3:])
                negate = inner is not None and _strip_optional(inner)[0] is bool
                key = key[3:] if negate else key
            if key not in _fields(cls):
                raise _unknown(cls, parents, parts[-1], opt)
            tp = _hints(cls)[key]
            if _is_section(tp):
                raise ConfigError(
                    f"{opt}: {'.'.join(parents + [key])!r} is a section; "
                    f"set one of its keys, e.g. {opt}.{next(iter(_fields(tp)))}"
                )
            dotted = ".".join(parents + [key])
            if dotted in given:
                raise ConfigError(
                    f"{opt}: {dotted} is set twice on the command line (first "
                    f"by {given[dotted]}); give it once"
                )
            given[dotted] = opt
            is_bool = _strip_optional(tp)[0] is bool
            has_next = i < len(argv) and not argv[i].startswith("--")
            if negate:
                if eq:
                    raise ConfigError(f"{opt}: a negated flag takes no value, got {value!r}")
                setattr(obj, key, False)
                continue
            if not eq:
                if has_next:
                    value, i = argv[i], i + 1
                elif is_bool:
                    value = "true"
                else:
                    raise ConfigError(f"{opt}: missing value (expected {_type_label(tp)})")
            try:
                setattr(obj, key, _convert(tp, value, from_cli=True))
            except _BadValue as e:
                raise ConfigError(f"{opt}: {e}") from None

    def help_text(self, config: Any | None = None) -> str:
        """Every option grouped by section, with type, current default and docstring."""
        config = self.config_cls() if config is None else config
        lines = [
            "usage: [--section.key VALUE | --section.key=VALUE | --section.flag | "
            "--section.no_flag] ...",
            "Precedence: dataclass defaults < --job.config_file TOML < command line. "
            "Keys accept - or _; lists are comma-separated; optional values accept 'none'.",
        ]
        self._help_section(config, [], lines)
        return "\n".join(lines)

    def _help_section(self, obj: Any, parents: list[str], lines: list[str]) -> None:
        cls: type = type(obj)
        docs = field_docs(cls)
        scalars = [f for f in dataclasses.fields(cls) if not _is_section(_hints(cls)[f.name])]
        if parents and scalars:
            lines.append(f"\n[{'.'.join(parents)}]")
            if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
                lines.append("  " + inspect.cleandoc(cls.__doc__).replace("\n", " "))
        for f in scalars:
            tp, opt = _hints(cls)[f.name], "--" + ".".join(parents + [f.name])
            if _strip_optional(tp)[0] is bool:
                neg = "--" + ".".join(parents + ["no_" + f.name])
                head = f"  {opt}, {neg}"
            else:
                head = f"  {opt} {_type_label(tp)}"
            lines.append(f"{head}  (default: {_format_value(getattr(obj, f.name))})")
            if f.name in docs:
                lines.append(
                    textwrap.fill(
                        docs[f.name], width=92, initial_indent=" " * 6, subsequent_indent=" " * 6
                    )
                )
        for f in dataclasses.fields(cls):
            if _is_section(_hints(cls)[f.name]):
                self._help_section(getattr(obj, f.name), parents + [f.name], lines)


def _format_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'  # read back as None for Optional fields
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr of inf/nan/1e-08 is valid TOML too
    if isinstance(value, str):
        escaped = "".join(
            {'"': '\\"', "\\": "\\\\"}.get(c, c)
            if ord(c) >= 0x20 and c != "\x7f"
            else f"\\u{ord(c):04x}"
            for c in value
        )
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(config: Any) -> str:
    """Serialise a config tree as TOML that parses back (via --job.config_file) to the same
    values. The config file path itself is written as a comment only."""
    lines: list[str] = []

    def emit(obj: Any, parents: list[str]) -> None:
        cls = type(obj)
        sections = [f.name for f in dataclasses.fields(cls) if _is_section(_hints(cls)[f.name])]
        scalars = [f.name for f in dataclasses.fields(cls) if f.name not in sections]
        if parents and scalars:
            lines.append(("\n" if lines else "") + f"[{'.'.join(parents)}]")
        for name in scalars:
            value = getattr(obj, name)
            if tuple(parents + [name]) == CONFIG_FILE_KEY:
                lines.append(f"# {name}: {_format_value(value)}")
            else:
                lines.append(f"{name} = {_toml_value(value)}")
        for name in sections:
            emit(getattr(obj, name), parents + [name])

    emit(config, [])
    return "\n".join(lines) + "\n"


def last_wins(argv: list[str]) -> list[str]:
    """`argv` with every option but its last occurrence dropped, for programs that build
    a command line from defaults plus overrides (the parser itself refuses an option
    given twice).  An option is a `--key` token with the values after it; `--s.flag` and
    `--s.no_flag` count as the same option."""
    groups: list[tuple[str, list[str]]] = []
    for tok in argv:
        if tok.startswith("--") or not groups:
            name = tok[2:].partition("=")[0].replace("-", "_")
            section, _, key = name.rpartition(".")
            key = key[3:] if key.startswith("no_") else key
            groups.append((f"{section}.{key}", [tok]))
        else:
            groups[-1][1].append(tok)
    last = {name: i for i, (name, _) in enumerate(groups)}
    return [tok for i, (name, toks) in enumerate(groups) if last[name] == i for tok in toks]


def main_parse(argv: list[str] | None = None, config_cls: type = JobConfig) -> Any:
    """Entry-point helper: parse, or print `error: <message>` to stderr and exit 2."""
    try:
        return ConfigManager(config_cls).parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
