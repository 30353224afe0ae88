"""`compose`: the one order the expert stack's pieces nest in, outermost first::

    retry ∘ faults ∘ brownout ∘ split(local, remote)

(why this order: :mod:`moefleet.experts.stack`). A module of its own so that the pieces
import the base class and this module imports the pieces, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from moefleet.experts.brownout import BrownoutExperts
from moefleet.experts.faults import FaultyExperts
from moefleet.experts.retry import RetryingExperts
from moefleet.experts.split import SplitExperts
from moefleet.experts.stack import ExpertStack, as_stack
from moefleet.models.base import ExpertFn

if TYPE_CHECKING:
    from moefleet.brownout.groups import Grouping
    from moefleet.brownout.united import UnitedExperts
    from moefleet.runtime.faults import FaultPlan
    from moefleet.runtime.retry import RetryPolicy


def compose(local: ExpertFn | ExpertStack | None = None, *,
            remote: ExpertStack | None = None,
            is_local: Mapping[int, torch.Tensor] | None = None,
            brownout: tuple[Grouping | UnitedExperts, float, str, str] | None = None,
            faults: FaultPlan | None = None,
            retry: RetryPolicy | None = None,
            wrap: Callable[[ExpertStack], ExpertStack | ExpertFn] | None = None
            ) -> ExpertStack:
    """Nest the pieces in the module's order and return the outermost.

    ``local`` / ``remote``: the experts computed here and by functions. Both given: Remoe's
    split (``is_local[layer]`` a bool [E]; a layer without an entry is all local); one:
    that one. ``brownout``: ``(united experts or grouping, threshold, mode, united_kernel)``.
    ``faults``: a plan injected at this seam (emulated). ``retry``: the policy of the
    outermost retry (None: no retry piece). ``wrap``: an extra piece just inside the
    retries, e.g. a profiler timing whatever the engine's experts cost.
    """
    if local is None and remote is None:
        raise ValueError("an expert stack needs local experts, remote experts, or both")
    base: ExpertStack
    if local is not None and remote is not None:
        base = SplitExperts(as_stack(local), remote, is_local or {})
    else:
        base = as_stack(local) if local is not None else remote  # type: ignore[assignment]
    if brownout is not None:
        groups, threshold, mode, united_kernel = brownout
        base = BrownoutExperts(base, groups, threshold, mode, united_kernel=united_kernel)
    if faults is not None and faults.kind != "none":
        base = FaultyExperts(base, faults)
    if wrap is not None:
        base = as_stack(wrap(base))
    if retry is not None:
        base = RetryingExperts(base, retry)
    return base
