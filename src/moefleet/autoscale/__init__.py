"""Autoscaling: the baseline scaling controllers (``baselines``), a FaaSConf-like one
(``faasconf``) and the sMoE RL controller (``smoe``).

Every one is a :class:`~moefleet.control.ScalingController`: a pure function of a
metrics snapshot; the simulator (``moefleet.sim``) and the runtime control loop
(``moefleet.runtime.control``) apply its decisions. The interface, the bounds and the
wrappers live in :mod:`moefleet.control`.
"""

from moefleet.autoscale.baselines import POLICIES, ElasticMoEPolicy, HPAPolicy, make_policy
from moefleet.autoscale.errors import AutoscaleError

__all__ = [
    "POLICIES",
    "AutoscaleError",
    "ElasticMoEPolicy",
    "HPAPolicy",
    "make_policy",
]
