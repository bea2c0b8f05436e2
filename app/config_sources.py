"""Where the configuration comes from, before validation: the TOML file, `BROKER_*` environment
overrides, programmatic overrides, and `<key>_file` indirections (secrets mounted as files)."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SECTIONS = (
    "server",
    "database",
    "identity",
    "keys",
    "limits",
    "audit",
    "logging",
    "admin",
    "connections",
)

NAMED_TABLES = ("providers", "services", "webhooks")  # [<table>.<name>], named by the operator


class ConfigError(Exception):
    """The configuration is unusable; the message names the key and says why."""


def env_variable(key: str) -> str:
    """The environment variable that sets the dotted `key` (`server.public_url` ->
    `BROKER_SERVER_PUBLIC_URL`; a provider's or service's key one level under its table)."""
    parts = key.split(".")
    depth = 3 if parts[0] in NAMED_TABLES else 2
    return "BROKER_" + "_".join(parts[:depth]).upper()


def config_path(explicit: str | None) -> Path | None:
    """The file to read: the explicit path, else BROKER_CONFIG, else ./broker.toml if present."""
    if explicit:
        return Path(explicit)
    if env := os.environ.get("BROKER_CONFIG"):
        return Path(env)
    default = Path("broker.toml")
    return default if default.exists() else None


def read_raw(
    path: Path | None, environ: Mapping[str, str], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """The merged, unvalidated configuration: file, then environment, then `overrides`
    (dotted keys), then `_file` keys replaced by their files' contents.

    Raises:
        ConfigError: naming the bad key or file.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(
                f"cannot read config file {path}: {exc.strerror} "
                "(give the right path with --config or BROKER_CONFIG)"
            ) from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not UTF-8 text (TOML files are)") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
        _check_tables(raw)
    _apply_environment(raw, environ)
    for dotted, value in overrides.items():
        _set_dotted(raw, dotted, value)
    _resolve_files(raw)
    return raw


def _check_tables(raw: dict[str, Any]) -> None:
    """The sections and named tables are tables (`server = 5` is not a [server] section), as
    everything after reads them as such.

    Raises:
        ConfigError: naming the first that is not.
    """
    for section in (*SECTIONS, *NAMED_TABLES):
        value = raw.get(section, {})
        if not isinstance(value, dict):
            raise ConfigError(f"{section}: must be a table ([{section}])")
        if section in NAMED_TABLES:
            for name, table in value.items():
                if not isinstance(table, dict):
                    raise ConfigError(f"{section}.{name}: must be a table ([{section}.{name}])")


def _apply_environment(raw: dict[str, Any], environ: Mapping[str, str]) -> None:
    """Set each key a `BROKER_*` variable names. Its value wins over the file's, including over
    the file's `<key>_file` (dropped), as a `BROKER_..._<KEY>_FILE` wins over the file's `<key>`.

    Raises:
        ConfigError: a variable names a table the file lacks, or both `X` and `X_FILE` are set.
    """
    named = {table: {name.upper(): name for name in raw.get(table, {})} for table in NAMED_TABLES}
    assigned: dict[str, tuple[str, str]] = {}  # dotted key: (variable, value)
    for variable, value in environ.items():
        if not variable.startswith("BROKER_") or variable == "BROKER_CONFIG":
            continue
        rest = variable.removeprefix("BROKER_")
        section, _, key = rest.partition("_")
        section = section.lower()
        if section in named:
            assigned[_named_key(variable, section, named[section], key)] = (variable, value)
        elif section in SECTIONS and key:
            assigned[f"{section}.{key.lower()}"] = (variable, value)
        # other BROKER_* variables belong to no section and are not ours to judge
    for dotted, (variable, value) in sorted(assigned.items()):
        if dotted.endswith("_file") and dotted.removesuffix("_file") in assigned:
            other = assigned[dotted.removesuffix("_file")][0]
            raise ConfigError(f"{other} and {variable} are both set; keep one")
        _set_dotted(raw, dotted, value)
        if not dotted.endswith("_file") and not dotted.startswith("webhooks."):
            _drop_dotted(raw, f"{dotted}_file")  # a webhook's `secret_file` is its own key


def _named_key(variable: str, section: str, names: dict[str, str], key: str) -> str:
    """The dotted key `BROKER_PROVIDERS_<NAME>_<KEY>` sets: the longest table name that
    prefixes the rest wins.

    Raises:
        ConfigError: no such table in the file.
    """
    match = next(
        (upper for upper in sorted(names, key=len, reverse=True) if key.startswith(upper + "_")),
        None,
    )
    if match is None:
        raise ConfigError(f"{variable}: no [{section}.<name>] table in the config file")
    return f"{section}.{names[match]}.{key[len(match) + 1 :].lower()}"


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a table")
        node = child
    node[leaf] = value


def _drop_dotted(raw: dict[str, Any], dotted: str) -> None:
    """Remove the dotted key, if there (its tables exist: a key was just set beside it)."""
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node[part]
    node.pop(leaf, None)


def _resolve_files(raw: dict[str, Any], prefix: str = "") -> None:
    for key in [k for k in raw if isinstance(k, str)]:
        value = raw[key]
        if not prefix and key == "webhooks":
            continue  # a webhook's `secret_file` is read by its settings, which allow no other
        if isinstance(value, dict):
            _resolve_files(value, f"{prefix}{key}.")
        elif key.endswith("_file") and isinstance(value, str):
            try:
                raw[key.removesuffix("_file")] = Path(value).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(f"{prefix}{key}: cannot read {value}: {exc.strerror}") from None
            except UnicodeDecodeError:
                raise ConfigError(f"{prefix}{key}: {value} is not UTF-8 text") from None
            del raw[key]
