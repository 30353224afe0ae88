"""The ``--brownout`` option: what brownout was asked for, and its grammar.

:class:`BrownoutSpec` holds a fixed threshold or the SLOs the pure
:class:`~moefleet.brownout.salc.SALC` controller steers the threshold by (an engine
step hook, :class:`~moefleet.experts.brownout_hook.SALCHook`, feeds it and applies its
decisions).

:func:`parse_brownout_spec` reads ``ways=8,threshold=0.4[,mode=full]`` (a fixed
threshold) or ``ways=8,slo-ttft=0.25,slo-tpot=0.15[,mode=full,warning=0.8,increment=0.1,
shrink=0.8,window=5,interval=1]`` (SALC; seconds), as ``moefleet serve --brownout`` and
``generate --brownout`` take it.
"""

from __future__ import annotations

from dataclasses import dataclass

from moefleet.brownout.groups import MODES, BrownoutError, check_threshold
from moefleet.brownout.salc import SALC

_FLOAT_KEYS = {"slo-ttft": "slo_ttft_s", "slo-tpot": "slo_tpot_s", "warning": "warning",
               "increment": "increment", "shrink": "shrink", "window": "window_s",
               "interval": "interval_s"}


@dataclass(frozen=True)
class BrownoutSpec:
    """Brownout as asked for: ``ways`` experts per united expert, and either a fixed
    ``threshold`` (SLOs None) or SLOs that SALC controls the threshold by (``threshold``
    is then where it starts: 1, zero brownout)."""

    ways: int
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    mode: str = "partial"
    threshold: float = 1.0
    warning: float = 0.8
    increment: float = 0.1
    shrink: float = 0.8
    window_s: float = 5.0
    interval_s: float = 1.0

    @property
    def controlled(self) -> bool:
        """SALC sets the threshold (both SLOs given), rather than a fixed one."""
        return self.slo_ttft_s is not None and self.slo_tpot_s is not None

    def salc(self) -> SALC:
        """The controllers (validates every number: SLOs > 0, ratios in range)."""
        if self.slo_ttft_s is None or self.slo_tpot_s is None:
            raise BrownoutError("SALC needs both SLOs", "give slo-ttft= and slo-tpot=")
        return SALC(self.slo_ttft_s, self.slo_tpot_s, warning=self.warning,
                    increment=self.increment, shrink=self.shrink, window_s=self.window_s,
                    interval_s=self.interval_s)


def parse_brownout_spec(text: str) -> BrownoutSpec:
    values: dict[str, object] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, raw = part.partition("=")
        if not sep:
            raise BrownoutError(f"--brownout item {part!r} is not key=value",
                                "write e.g. ways=8,slo-ttft=0.25,slo-tpot=0.15")
        if key == "ways":
            try:
                values["ways"] = int(raw)
            except ValueError:
                raise BrownoutError(f"--brownout ways={raw!r} is not an integer",
                                    "use e.g. ways=8") from None
        elif key == "mode":
            if raw not in MODES:
                raise BrownoutError(f"--brownout mode={raw!r} is unknown", f"use one of {MODES}")
            values["mode"] = raw
        elif key == "threshold":
            try:
                values["threshold"] = check_threshold(float(raw))
            except ValueError:
                raise BrownoutError(f"--brownout threshold={raw!r} is not a number",
                                    "use a number in [0, 1], e.g. threshold=0.4") from None
        elif key in _FLOAT_KEYS:
            try:
                values[_FLOAT_KEYS[key]] = float(raw)
            except ValueError:
                raise BrownoutError(f"--brownout {key}={raw!r} is not a number",
                                    "give seconds, e.g. slo-ttft=0.25") from None
        else:
            raise BrownoutError(f"--brownout key {key!r} is unknown",
                                f"keys: ways, mode, threshold, {', '.join(_FLOAT_KEYS)}")
    slos = [k for k in ("slo_ttft_s", "slo_tpot_s") if k in values]
    if len(slos) == 1 and "threshold" not in values:
        missing = "slo-tpot=" if slos == ["slo_ttft_s"] else "slo-ttft="
        raise BrownoutError(f"--brownout {text!r} lacks {missing}: SALC needs both SLOs",
                            f"add {missing}, e.g. ways=8,slo-ttft=0.25,slo-tpot=0.15")
    if "ways" not in values or ("threshold" in values) == (len(slos) == 2) or len(slos) == 1:
        raise BrownoutError(f"--brownout {text!r} needs ways= and either threshold= (fixed) "
                            "or both slo-ttft= and slo-tpot= (SALC)",
                            "write e.g. ways=8,threshold=0.4 or ways=8,slo-ttft=0.25,"
                            "slo-tpot=0.15")
    spec = BrownoutSpec(**values)  # type: ignore[arg-type]
    if spec.ways < 2:
        raise BrownoutError(f"--brownout ways={spec.ways} is below 2", "use 2 or more")
    if spec.controlled:
        spec.salc()  # range checks, with messages naming the value
    return spec
