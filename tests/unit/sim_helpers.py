"""Hand-checkable fixtures for the simulator tests: a platform with round numbers and
profiles built by hand (no measurement).

Platform ``sim-test``: 1024/2048/4096 MB = 1/2/4 vCPUs; $1e-5 per GB-s, $1e-6 per
request, 1 ms billing, INIT billed; cold start 1.0 s, warm start 0.1 s; object store
T_acc = 0.01 s, B_s = 1e6 B/s, PUT $5e-6, GET $4e-7; B_f = 2e6 B/s; payload limit 1 MB.
Profile: D = 1000 bytes per token; expert 0.01 s per token (1 MB of parameters:
cold parameter download 0.01 + 1.0 s), segment 0.001 s per token (no parameters);
thread law T(v) = exp(-ln2·v): 2 vCPUs run twice as fast as 1.
"""

from __future__ import annotations

import math

from moefleet.plan import DeploymentPlan, ExpertConfig, LayerPlan, Method
from moefleet.platform import PlatformSpec, parse_platform
from moefleet.profiles import BatchLaw, ComputeProfile, FunctionProfile, ThreadLaw
from moefleet.workloads import Arrival

HALVING = ThreadLaw(theta1=1.0, theta2=math.log(2.0), theta3=0.0)
GB_S = 1e-5
REQ = 1e-6
PUT = 5e-6
GET = 4e-7


def spec() -> PlatformSpec:
    return parse_platform({
        "name": "sim-test", "kind": "faas", "provider": "test", "description": "round numbers",
        "as_of": "2025-01",
        "memory": {"options_mb": [1024, 2048, 4096]},
        "vcpu": {"rule": "linear", "mb_per_vcpu": 1024.0, "max_vcpu": 4.0},
        "prices": {"per_gb_s": GB_S, "per_request": REQ},
        "billing": {"granularity_ms": 1, "min_billed_ms": 1, "init_billed": True},
        "limits": {"sync_payload_bytes": 1_000_000, "async_payload_bytes": 262144,
                   "max_replicas": 100, "max_concurrency_per_instance": 4},
        "startup": {"cold_start_s": 1.0, "warm_start_s": 0.1},
        "storage": {"service": "test", "access_latency_s": 0.01,
                    "bandwidth_bytes_per_s": 1e6, "price_per_put": PUT, "price_per_get": GET},
        "network": {"function_bandwidth_bytes_per_s": 2e6},
    })


def profile(blocks: int = 1, expert_s: float = 0.01, segment_s: float = 0.001,
            expert_params: int = 1_000_000) -> ComputeProfile:
    moe = list(range(blocks))
    return ComputeProfile(
        model="hand", hidden_size=250, moe_layers=moe,
        experts={b: FunctionProfile(BatchLaw(0.0, expert_s), HALVING, expert_params)
                 for b in moe},
        segments=[FunctionProfile(BatchLaw(0.0, segment_s), HALVING, 0) for _ in moe],
        bytes_per_token=1000)


def plan(experts: int = 1, blocks: int = 1, method: Method = "direct", memory_mb: int = 1024,
         replicas: int = 1, beta: int = 1, segment_mb: int = 1024) -> DeploymentPlan:
    return DeploymentPlan(
        model="hand", platform="sim-test", segment_memory_mb=[segment_mb] * blocks,
        layers=[LayerPlan(layer=b, method=method, beta=beta,
                          experts=[ExpertConfig(memory_mb=memory_mb, replicas=replicas)]
                          * experts) for b in range(blocks)])


def arrivals(*times: float, prompt: int = 10, output: int | None = None) -> list[Arrival]:
    return [Arrival(t, f"r{i}", prompt, output) for i, t in enumerate(times)]
