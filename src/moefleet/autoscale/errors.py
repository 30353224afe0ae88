"""The autoscalers' error: a setting of sMoE or a baseline that cannot be honoured."""

from __future__ import annotations

from moefleet.control.base import ControlError


class AutoscaleError(ControlError):
    """A scaling controller's setting, checkpoint or scenario that cannot be used."""
