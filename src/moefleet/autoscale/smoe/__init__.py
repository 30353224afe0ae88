"""sMoE: a deep-RL per-expert autoscaler (DAGNN + layer-wise pointer actor + DDPG).

    dag = PipelineDAG.from_plan(plan, profile)       # nodes, edges, topological batches
    agent = SmoeAgent(dag, ConfigSpace(), ActorSpec())
    ctl = SmoeController(agent, slo_s, price_per_s)  # the ScalingController interface

``graph``: the DAG and state features; ``space``: configurations and the memory filter;
``nets``: the networks; ``agent``: DDPG and the controller; ``harness``: the simulator
scenario every controller is compared on; ``popularity``: the popularity-aware static
plan (``static-pop`` baseline) and the warm start's teacher; ``imitation``: behaviour
cloning of the teacher; ``train``: offline training; ``checkpoint``/``restore``: the
checkpoint file (safetensors + schema-checked JSON, nothing pickled) and loading it into
an agent; ``convert``: the one-off converter from pickled format-1 checkpoints.
"""

from moefleet.autoscale.smoe.agent import DDPGConfig, SmoeAgent, SmoeController, group_rewards
from moefleet.autoscale.smoe.graph import NUM_FEATURES, PipelineDAG, node_features
from moefleet.autoscale.smoe.nets import ActorSpec, SmoeActor, SmoeCritic, soft_action
from moefleet.autoscale.smoe.space import ConfigSpace

__all__ = [
    "NUM_FEATURES",
    "ActorSpec",
    "ConfigSpace",
    "DDPGConfig",
    "PipelineDAG",
    "SmoeActor",
    "SmoeAgent",
    "SmoeController",
    "SmoeCritic",
    "group_rewards",
    "node_features",
    "soft_action",
]
