"""The platform's function startup, emulated on the ``local`` backend (``startup=
"platform"``).

A local worker forks from a server that imported torch once, so a local cold start pays
only the instance's construction and weight load, and a warm call only a pipe round trip:
far less than a platform's runtime start and invoke round trip (``startup.cold_start_s``
and ``warm_start_s`` of its spec, what the simulator charges). With the emulation on, every
call waits ``warm_start_s`` more and a cold one ``cold_start_s`` more; the cold part is
added to the call's INIT time, so it is billed where the platform bills INIT, and the
warm part is not billed (the invoke round trip is not on the platform's meter either).

The wait happens in the caller after the worker answered, with the instance still held
(a call meanwhile takes another instance, or cold-starts one, as on the platform) and the
worker's slot free (a platform's environments start in parallel; a local worker is a
CPU slot, and sleeping in it would serialise them). Both parts are added on top of what
was measured, never instead of it: the emulation can only make a run slower and dearer.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Literal

from moefleet.platform import InvocationRecord, PlatformSpec

StartupMode = Literal["measured", "platform"]
STARTUP_MODES: tuple[str, ...] = ("measured", "platform")


@dataclass(frozen=True)
class StartupEmulation:
    """Seconds added to each call (``warm_s``) and to each cold one (``cold_s``)."""

    cold_s: float
    warm_s: float

    @classmethod
    def of(cls, platform: PlatformSpec, mode: str) -> StartupEmulation | None:
        """The emulation ``mode`` asks for (None: startup as measured)."""
        if mode not in STARTUP_MODES:
            raise ValueError(f"startup must be one of {', '.join(STARTUP_MODES)}, got "
                             f"{mode!r}")
        if mode == "measured" or platform.startup is None:
            return None
        return cls(platform.startup.cold_start_s, platform.startup.warm_start_s)

    @property
    def note(self) -> str:
        return (f"emulated: each call +{self.warm_s:g} s (invoke round trip, not billed), "
                f"each cold start +{self.cold_s:g} s of INIT (the platform's startup)")

    def wait(self, record: InvocationRecord) -> InvocationRecord:
        """Sleep the emulated startup of ``record``'s call; the record with it billed."""
        time.sleep(self.warm_s + (self.cold_s if record.cold else 0.0))
        if not record.cold:
            return record
        return dataclasses.replace(record, init_s=record.init_s + self.cold_s)
