"""The one shape of seam 3: a controller observes a window of metrics and decides.

A controller is a pure function ``decide(window, state) -> (decision, state)`` called by
a driver (the simulator's control process, the runtime control loop, an engine step
hook), in the style of Ray Serve's autoscaling policies. Invariants every controller
keeps (``tests/contracts/test_controllers.py`` checks them for each one we ship):

- it never reads a clock: the window carries the time;
- it never mutates the window or the state it is given (states are immutable values,
  e.g. ``None``, a tuple or a frozen dataclass); the same window and state give the
  same decision and the same next state;
- an empty window (no samples, no functions) is a valid input.

Controllers differ only in their window and decision types: scaling controllers
(:mod:`.scaling`) read a :class:`~moefleet.control.scaling.MetricsSnapshot` and decide
function configurations; SALC (:mod:`moefleet.brownout.salc`) reads a latency window and
decides brownout thresholds. This package sits low: it imports only ``errors``.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

from moefleet.errors import MoefleetError

W_contra = TypeVar("W_contra", contravariant=True)  # what the controller observes
D_co = TypeVar("D_co", covariant=True)  # what it decides
S = TypeVar("S")  # its state (an immutable value)

APPLY_DELAY_S = 1.0  # default delay between a decision and its effect, in every driver


class ControlError(MoefleetError):
    """A controller, bound or control setting that cannot be honoured."""


@runtime_checkable
class Controller(Protocol[W_contra, D_co, S]):
    """``decide(window, state) -> (decision, state)``, pure (see the module docstring).

    ``initial_state()`` is the state a driver starts from; ``name`` labels results.
    """

    name: str

    def initial_state(self) -> S: ...

    def decide(self, window: W_contra, state: S) -> tuple[D_co, S]: ...
