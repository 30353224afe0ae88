"""The platform catalog: YAML files shipped inside the package, loaded into ``PlatformSpec``.

The files live in ``moefleet/embedded/platforms/<name>.yaml`` so that non-editable installs
carry them (``pyproject.toml`` already ships ``embedded/**/*`` as package data);
``configs/platforms/README.md`` at the repository root points here. A user's own platform
is any YAML file with the same schema, passed by path.
"""

from __future__ import annotations

import difflib
import functools
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from moefleet.errors import MoefleetError, UnknownNameError
from moefleet.io import read_text_input, yaml_error_line
from moefleet.platform.errors import PlatformConfigError
from moefleet.platform.specs import PlatformSpec

CATALOG_DIR = Path(__file__).resolve().parent.parent / "embedded" / "platforms"
DEFAULT_PLATFORM = "aws-lambda"


def catalog_dir() -> Path:
    """Directory of the shipped platform YAML files."""
    return CATALOG_DIR


def list_platforms() -> list[str]:
    """Names of the catalog's platforms, sorted."""
    return sorted(p.stem for p in CATALOG_DIR.glob("*.yaml"))


def load_platform(name_or_path: str | os.PathLike[str]) -> PlatformSpec:
    """A catalog platform by name (``"aws-lambda"``) or any platform YAML file by path.

    Raises ``UnknownNameError`` (listing the known names) for an unknown name and
    ``PlatformConfigError`` (naming the file and field) for an invalid file.
    """
    text = os.fspath(name_or_path)
    looks_like_path = (
        isinstance(name_or_path, os.PathLike)
        or text.endswith((".yaml", ".yml"))
        or os.sep in text
        or "/" in text
    )
    if looks_like_path:
        return load_platform_file(Path(text).expanduser())
    return _load_catalog_entry(text)


@functools.cache
def _load_catalog_entry(name: str) -> PlatformSpec:
    # Cached: specs are frozen, and the shipped files do not change while we run.
    known = list_platforms()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise UnknownNameError(
            f"unknown platform '{name}'",
            f"{hint}known platforms: {', '.join(known)}; or pass a path to a platform YAML",
        )
    spec = load_platform_file(CATALOG_DIR / f"{name}.yaml")
    if spec.name != name:
        raise PlatformConfigError(
            f"{CATALOG_DIR / (name + '.yaml')}: field 'name': is '{spec.name}' but the file "
            f"is named '{name}.yaml'",
            "make the name match the file name",
        )
    return spec


def load_platform_file(path: Path) -> PlatformSpec:
    """Parse and validate one platform YAML file."""
    if not path.is_file():
        raise PlatformConfigError(
            f"platform file not found: {path}", f"known platforms: {', '.join(list_platforms())}"
        )
    try:
        text = read_text_input(path, "platform file", "see configs/platforms/README.md")
    except MoefleetError as err:
        raise PlatformConfigError(err.message, err.hint) from None
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as err:
        raise PlatformConfigError(f"{path}: cannot read YAML: {yaml_error_line(err)}",
                                  "fix the syntax") from None
    return parse_platform(data, source=str(path))


def parse_platform(data: Any, source: str = "<platform>") -> PlatformSpec:
    """Validate a mapping (already parsed YAML/JSON) into a ``PlatformSpec``.

    ``source`` names the origin in error messages.
    """
    if not isinstance(data, dict):
        raise PlatformConfigError(
            f"{source}: expected a mapping of fields, got {type(data).__name__}",
            "see configs/platforms/README.md for the schema",
        )
    try:
        return PlatformSpec.model_validate(data)
    except ValidationError as err:
        raise _config_error(err, source) from None


def _config_error(err: ValidationError, source: str) -> PlatformConfigError:
    """One message per failing field: ``<file>: field 'billing.granularity_ms': ...``."""
    parts: list[str] = []
    for e in err.errors():
        # Drop the discriminator tag (``vcpu.linear.mb_per_vcpu`` → ``vcpu.mb_per_vcpu``).
        loc = [str(p) for p in e["loc"]]
        if len(loc) > 1 and loc[0] == "vcpu" and loc[1] in ("linear", "table", "fixed"):
            del loc[1]
        where = ".".join(loc)
        if e["type"] == "missing":
            msg = "missing required field"
        elif e["type"] == "extra_forbidden":
            msg = "unknown field (not in the schema)"
        elif e["type"] == "value_error":
            msg = str(e["msg"]).removeprefix("Value error, ")
        else:
            msg = f"{e['msg']} (got {e['input']!r})"
        parts.append(f"field '{where}': {msg}" if where else msg)
    return PlatformConfigError(
        f"{source}: " + "; ".join(parts),
        "fix the field(s) named; see configs/platforms/README.md for the schema",
    )
