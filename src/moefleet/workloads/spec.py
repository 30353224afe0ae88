"""Build a workload from a short spec: ``"kind:key=value,key=value"`` or a dict.

Examples::

    poisson:rate=5                 bursty:rate=5,cv=3         step:rate=2,at=60,factor=2
    azure-fn:rank=0                azure-fn:top=5,scale=0.5   azure-fn:function=9a3e...,start=120
    azure-llm:trace=conv           azure-llm:trace=code,speedup=2
    {"kind": "bursty", "rate": 5, "cv": 3}

Keys (long constructor names are accepted as aliases): poisson ``rate``; bursty
``rate, cv``; step ``rate, at, factor``; azure-fn one of ``rank`` / ``function`` (hash or
prefix; several joined with ``+``) / ``top`` (aggregate the N busiest), plus ``scale``,
``start`` (minute offset), ``path``; azure-llm ``trace``, ``speedup``, ``path``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from moefleet.errors import MoefleetError, UnknownNameError
from moefleet.workloads.azure_functions import AzureFunctionsWorkload
from moefleet.workloads.azure_llm import AzureLLMWorkload
from moefleet.workloads.base import Workload
from moefleet.workloads.bursty import BurstyWorkload
from moefleet.workloads.poisson import PoissonWorkload
from moefleet.workloads.step import StepWorkload

Converter = Callable[[Any], Any]


def _num(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("not a number")
    return float(v)


def _int(v: Any) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError("not an integer")
    return int(v)


def _str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("not a non-empty string")
    return v


# kind -> {accepted key: (canonical key, converter)}
_KEYS: dict[str, dict[str, tuple[str, Converter]]] = {
    "poisson": {"rate": ("rate", _num), "rate_rps": ("rate", _num)},
    "bursty": {"rate": ("rate", _num), "rate_rps": ("rate", _num), "cv": ("cv", _num)},
    "step": {"rate": ("rate", _num), "base_rps": ("rate", _num), "at": ("at", _num),
             "step_at_s": ("at", _num), "factor": ("factor", _num)},
    "azure-fn": {"rank": ("rank", _int), "function": ("function", _str),
                 "hash": ("function", _str), "top": ("top", _int), "scale": ("scale", _num),
                 "start": ("start", _int), "start_minute": ("start", _int),
                 "path": ("path", _str)},
    "azure-llm": {"trace": ("trace", _str), "speedup": ("speedup", _num),
                  "path": ("path", _str)},
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "poisson": ("rate",), "bursty": ("rate", "cv"), "step": ("rate", "at"),
    "azure-fn": (), "azure-llm": (),
}
KINDS: tuple[str, ...] = tuple(_KEYS)


def load_workload(spec: str | Mapping[str, Any] | Workload) -> Workload:
    """The workload a spec describes (a :class:`Workload` is returned unchanged).

    Raises :class:`UnknownNameError` for an unknown kind (listing the kinds) and
    :class:`MoefleetError` for a malformed spec, unknown/missing key or bad value.
    """
    if isinstance(spec, Workload):
        return spec
    kind, raw = _split(spec)
    if kind not in _KEYS:
        raise UnknownNameError(f"unknown workload kind '{kind}'",
                               f"use one of: {', '.join(KINDS)}")
    keys = _KEYS[kind]
    params: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in keys:
            raise MoefleetError(f"workload '{kind}' has no parameter '{key}'",
                                f"accepted: {', '.join(keys)}")
        canon, conv = keys[key]
        if canon in params:
            raise MoefleetError(f"workload '{kind}': parameter '{canon}' given twice",
                                "give each parameter once")
        try:
            params[canon] = conv(value)
        except (TypeError, ValueError):
            raise MoefleetError(f"workload '{kind}': {key}={value!r} is not valid "
                                f"({conv.__name__.strip('_')} expected)",
                                f"fix the value of '{key}'") from None
    missing = [k for k in _REQUIRED[kind] if k not in params]
    if missing:
        raise MoefleetError(f"workload '{kind}' needs {', '.join(missing)}",
                            f"e.g. {_EXAMPLES[kind]}")
    return _BUILD[kind](params)


def _split(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, Mapping):
        raw = dict(spec)
        kind = raw.pop("kind", None)
        if not isinstance(kind, str):
            raise MoefleetError(f"workload dict needs a string 'kind', got {kind!r}",
                                f"e.g. {{'kind': 'poisson', 'rate': 5}}; kinds: {', '.join(KINDS)}")
        return kind.strip().lower(), raw
    if not isinstance(spec, str) or not spec.strip():
        raise MoefleetError(f"workload spec must be a non-empty string or dict, got {spec!r}",
                            "e.g. 'poisson:rate=5'")
    kind, _, rest = spec.strip().partition(":")
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise MoefleetError(f"workload spec '{spec}': '{item}' is not key=value",
                                "e.g. 'bursty:rate=5,cv=3'")
        if key in out:
            raise MoefleetError(f"workload spec '{spec}': '{key}' given twice",
                                "give each parameter once")
        out[key] = value.strip()
    return kind.strip().lower(), out


def _azure_fn(p: dict[str, Any]) -> Workload:
    chosen = [k for k in ("rank", "function", "top") if k in p]
    if len(chosen) > 1:
        raise MoefleetError(f"workload 'azure-fn': give one of rank, function, top (got "
                            f"{', '.join(chosen)})", "e.g. azure-fn:rank=0")
    function: Any = p.get("rank", 0)
    if "function" in p:
        function = p["function"].split("+")
    if "top" in p:
        if p["top"] < 1:
            raise MoefleetError(f"workload 'azure-fn': top={p['top']} must be >= 1",
                                "e.g. azure-fn:top=5")
        function = list(range(p["top"]))
    return AzureFunctionsWorkload(function, path=p.get("path"), scale=p.get("scale", 1.0),
                                  start_minute=p.get("start"))


_BUILD: dict[str, Callable[[dict[str, Any]], Workload]] = {
    "poisson": lambda p: PoissonWorkload(p["rate"]),
    "bursty": lambda p: BurstyWorkload(p["rate"], p["cv"]),
    "step": lambda p: StepWorkload(p["rate"], p["at"], p.get("factor", 2.0)),
    "azure-fn": _azure_fn,
    "azure-llm": lambda p: AzureLLMWorkload(p.get("trace", "conv"), path=p.get("path"),
                                            speedup=p.get("speedup", 1.0)),
}
_EXAMPLES = {
    "poisson": "poisson:rate=5", "bursty": "bursty:rate=5,cv=3",
    "step": "step:rate=2,at=60,factor=2", "azure-fn": "azure-fn:rank=0",
    "azure-llm": "azure-llm:trace=conv",
}
