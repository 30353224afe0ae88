"""``DeploymentPlan``: how a model is laid out as serverless functions.

One vocabulary for the analytical model, the simulator and the runtime:

- every block ``l`` of the model has a non-expert **segment function** (attention,
  norms, gate, dense/shared MLPs; block 0 also embeds, the last also holds the head);
- every routed expert ``(l, i)`` of an MoE layer is an **expert function** with a memory
  size and ``replicas`` instances; replicas split the expert's tokens evenly
  (ceil(d / g) each, ODS/BO);
- every MoE layer chooses one **scatter-gather method** (ODS/BO's a):
    ``pipelined`` (a=1): object storage, minibatches of ``beta`` tokens, download and
                  compute of one minibatch overlap the upload of the previous one;
    ``storage``   (a=2): object storage, no pipelining;
    ``direct``    (a=3): tokens travel in the invocation payload (payload limit applies).

YAML round-trips exactly (``to_yaml`` / ``from_yaml``); validation errors name the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moefleet.errors import MoefleetError, validation_message
from moefleet.io import read_text_input, write_text_atomic, yaml_error_line
from moefleet.limits import MAX_BATCH_TOKENS, MAX_REPLICAS
from moefleet.plan.placement import Placement

#: Largest function memory a plan may name (MB); platforms check their own options.
MAX_MEMORY_MB = 10**7

Method = Literal["pipelined", "storage", "direct"]
METHOD_CODES: dict[Method, int] = {"pipelined": 1, "storage": 2, "direct": 3}
CODE_METHODS: dict[int, Method] = {v: k for k, v in METHOD_CODES.items()}


def even_chunks(d: int, g: int) -> list[int]:
    """How ``d`` token-slots of one expert split over its ``g`` replicas when nothing
    assigns them (the ``direct`` method): ``ceil(d / g)`` per replica in order, the last
    ones smaller or empty. The runtime's scatter and Remoe's simulator both cut so."""
    chunk = -(-d // g) if d > 0 else 0
    return [max(0, min(chunk, d - r * chunk)) for r in range(g)]


class PlanError(MoefleetError):
    """A plan file or object that is malformed or does not fit the model/platform."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class ExpertConfig(_Strict):
    # strict: YAML `true` or 128.7 is a typo, not 1 or 128 MB.
    memory_mb: int = Field(gt=0, le=MAX_MEMORY_MB, strict=True,
                           description="Function memory size (MB).")
    replicas: int = Field(1, ge=1, le=MAX_REPLICAS, strict=True,
                          description="Instances that split this expert's tokens.")


class LayerPlan(_Strict):
    layer: int = Field(ge=0, description="Block index of the MoE layer.")
    method: Method = "direct"
    beta: int = Field(1, ge=1, le=MAX_BATCH_TOKENS, strict=True,
                      description="Minibatch size (tokens) for 'pipelined'.")
    experts: list[ExpertConfig]

    @model_validator(mode="before")
    @classmethod
    def _method_codes(cls, data: Any) -> Any:
        # Accept the paper's numeric codes (1, 2, 3) as well as names.
        if isinstance(data, dict) and isinstance(data.get("method"), int):
            code = data["method"]
            if code not in CODE_METHODS:
                raise ValueError(f"method code must be 1, 2 or 3, got {code}")
            data = {**data, "method": CODE_METHODS[code]}
        return data

    @property
    def method_code(self) -> int:
        return METHOD_CODES[self.method]


class MainFunction(_Strict):
    """Remoe's main function: non-experts (on the GPU when ``gpu_gb`` > 0), the KV cache
    and every expert no group holds (its local experts), in CPU memory ``memory_mb``."""

    memory_mb: int = Field(gt=0, le=MAX_MEMORY_MB, strict=True,
                           description="CPU memory of the main function (MB).")
    gpu_gb: float = Field(0.0, ge=0, le=10**5, allow_inf_nan=False,
                          description="GPU memory it holds (GB); 0: CPU only.")


class ExpertGroup(_Strict):
    """Several experts of one MoE layer in one function with ``replicas`` instances."""

    layer: int = Field(ge=0)
    experts: list[Annotated[int, Field(ge=0, strict=True)]] = Field(min_length=1)
    memory_mb: int = Field(gt=0, le=MAX_MEMORY_MB, strict=True)
    replicas: int = Field(1, ge=1, le=MAX_REPLICAS, strict=True)
    replica_experts: list[list[Annotated[int, Field(ge=0, strict=True)]]] | None = Field(
        default=None, description="Remoe's LPT: replica j serves the experts "
        "replica_experts[j]; absent: every replica serves every expert, slots split evenly.")

    @model_validator(mode="after")
    def _replicas_cover_experts(self) -> ExpertGroup:
        rx = self.replica_experts
        if rx is None:
            return self
        flat = sorted(e for g in rx for e in g)
        if len(rx) != self.replicas or flat != sorted(self.experts) or not all(rx):
            raise ValueError(
                f"group of layer {self.layer}: replica_experts {rx} must give each of the "
                f"{self.replicas} replicas a non-empty set and each of the experts "
                f"{self.experts} exactly once (or drop it: slots then split evenly)")
        return self

    def replica_of(self) -> dict[int, int] | None:
        """expert -> the replica that serves all its slots (None: split evenly)."""
        if self.replica_experts is None:
            return None
        return {e: r for r, g in enumerate(self.replica_experts) for e in g}


class DeploymentPlan(_Strict):
    model: str = Field(description="Model the plan was made for (zoo name or path).")
    platform: str = Field(description="Platform spec name.")
    segment_memory_mb: list[Annotated[int, Field(gt=0, le=MAX_MEMORY_MB, strict=True)]] = Field(
        description="Memory of each block's non-expert segment function, one per block."
    )
    layers: list[LayerPlan]
    policy: str = "manual"
    predicted: dict[str, float] = Field(
        default_factory=dict, description="Planner's own estimates (cost_usd, latency_s ...)."
    )
    meta: dict[str, Any] = Field(default_factory=dict)
    main: MainFunction | None = Field(
        default=None, description="Remoe: the main function (then segments are empty).")
    groups: list[ExpertGroup] = Field(
        default_factory=list, description="Remoe: remote expert functions, one per layer.")

    @model_validator(mode="after")
    def _groups_fit_layers(self) -> DeploymentPlan:
        if self.groups and self.main is None:
            raise ValueError("expert groups need a main function (Remoe plans)")
        sizes = {lp.layer: len(lp.experts) for lp in self.layers}
        for g in self.groups:
            if g.layer not in sizes:
                raise ValueError(f"group of layer {g.layer}: the plan has no such MoE layer")
            if max(g.experts) >= sizes[g.layer] or len(set(g.experts)) != len(g.experts):
                raise ValueError(f"group of layer {g.layer}: expert ids must be distinct "
                                 f"and below {sizes[g.layer]}, got {g.experts}")
        # Each expert lives in one function: two groups holding it would double its
        # calls' bills, and identical groups would get the same function name.
        held: dict[tuple[int, int], int] = {}
        for i, g in enumerate(self.groups):
            for e in g.experts:
                j = held.setdefault((g.layer, e), i)
                if j != i:
                    raise ValueError(f"expert {e} of layer {g.layer} is in groups {j} and "
                                     f"{i}; each expert belongs to at most one group")
        return self

    @model_validator(mode="after")
    def _finite_predictions(self) -> DeploymentPlan:
        bad = {k: v for k, v in self.predicted.items() if not math.isfinite(v)}
        if bad:
            raise ValueError(f"predicted values must be finite numbers, got {bad}")
        return self

    @model_validator(mode="after")
    def _unique_layers(self) -> DeploymentPlan:
        seen = [lp.layer for lp in self.layers]
        if len(seen) != len(set(seen)):
            raise ValueError(f"layers listed more than once: {seen}")
        if seen != sorted(seen):
            raise ValueError(f"layers must be in increasing order, got {seen}")
        return self

    # -- access ----------------------------------------------------------------------
    def layer(self, layer: int) -> LayerPlan:
        for lp in self.layers:
            if lp.layer == layer:
                return lp
        raise KeyError(f"plan has no MoE layer {layer}")

    def placement(self) -> Placement:
        """The plan's functions: one segment per block, one function per expert (names,
        memory, replicas). Everything that needs a function name reads this. A plan with
        a ``main`` function has no segments and one function per expert group."""
        if self.main is not None:
            return Placement.build(
                self.segment_memory_mb,
                ((g.layer, tuple(g.experts), g.memory_mb, g.replicas) for g in self.groups),
                main_memory_mb=self.main.memory_mb)
        return Placement.build(
            self.segment_memory_mb,
            ((lp.layer, (i,), ec.memory_mb, ec.replicas)
             for lp in self.layers for i, ec in enumerate(lp.experts)))

    def main_expert_ids(self, layer: int) -> list[int]:
        """Experts of ``layer`` that the main function holds (none without a main)."""
        if self.main is None:
            return []
        held = {e for g in self.groups if g.layer == layer for e in g.experts}
        return [i for i in range(len(self.layer(layer).experts)) if i not in held]

    def function_names(self) -> list[str]:
        return self.placement().names

    # -- checks against a model and a platform ----------------------------------------
    def check_model(self, moe_layers: list[int], num_experts: list[int], num_blocks: int) -> None:
        # A main function runs every block itself, so its plans have no segments.
        if self.main is None and len(self.segment_memory_mb) != num_blocks:
            raise PlanError(
                f"plan has {len(self.segment_memory_mb)} segment functions, the model has "
                f"{num_blocks} blocks",
                "re-plan for this model (moefleet plan --model ...)",
            )
        if [lp.layer for lp in self.layers] != list(moe_layers):
            raise PlanError(
                f"plan covers MoE layers {[lp.layer for lp in self.layers]}, the model has "
                f"{list(moe_layers)}",
                "the plan was made for another model; re-plan for this one",
            )
        for lp, e in zip(self.layers, num_experts, strict=True):
            if len(lp.experts) != e:
                raise PlanError(
                    f"layer {lp.layer}: plan has {len(lp.experts)} experts, the model {e}",
                    "the plan was made for another model; re-plan for this one",
                )

    def check_platform(self, spec: Any) -> None:
        """Memory sizes offered and replica limits of ``spec`` (a PlatformSpec)."""
        where = "segment_memory_mb"
        try:
            for m in self.segment_memory_mb:
                spec.check_memory(m)
            for lp in self.layers:
                for i, ec in enumerate(lp.experts):
                    where = f"layers[{lp.layer}].experts[{i}]"
                    spec.check_memory(ec.memory_mb)
        except MoefleetError as err:
            raise PlanError(f"{where}: {err.message}", err.hint) from err
        if self.main is not None and self.main.gpu_gb > 0:
            gpu = getattr(spec, "gpu", None)
            if gpu is None:
                raise PlanError(f"main.gpu_gb = {self.main.gpu_gb:g} but platform "
                                f"'{spec.name}' has no GPU functions",
                                "set main.gpu_gb to 0, or plan for a GPU platform")
            if self.main.gpu_gb > gpu.memory_gb:
                raise PlanError(f"main.gpu_gb = {self.main.gpu_gb:g} GB is more than the "
                                f"{gpu.memory_gb:g} GB GPU of platform '{spec.name}'",
                                f"set main.gpu_gb to at most {gpu.memory_gb:g}")
        max_rep = getattr(getattr(spec, "limits", None), "max_replicas", None)
        if max_rep:
            for lp in self.layers:
                for i, ec in enumerate(lp.experts):
                    if ec.replicas > max_rep:
                        raise PlanError(
                            f"layers[{lp.layer}].experts[{i}].replicas = {ec.replicas} exceeds "
                            f"the platform's limit {max_rep}",
                            f"use at most {max_rep} replicas",
                        )

    # -- YAML ------------------------------------------------------------------------
    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def save(self, path: str | Path) -> Path:
        write_text_atomic(path, self.to_yaml())
        return Path(path)

    @classmethod
    def from_yaml(cls, text: str, source: str = "<plan>") -> DeploymentPlan:
        try:
            data = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError) as err:
            raise PlanError(f"{source} is not valid YAML: {yaml_error_line(err)}",
                            "fix the syntax") from None
        if not isinstance(data, dict):
            raise PlanError(f"{source} must hold a mapping", "see `moefleet plan --help`")
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise PlanError(validation_message(err, source),
                            f"fix that field ({err.error_count()} problem(s) in total)") from None

    @classmethod
    def load(cls, path: str | Path) -> DeploymentPlan:
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"plan file {p} does not exist", "write one with moefleet plan -o")
        return cls.from_yaml(read_text_input(p, "plan file", "write one with moefleet plan -o"),
                             source=str(p))

    @classmethod
    def uniform(
        cls,
        model: str,
        platform: str,
        moe_layers: list[int],
        num_experts: list[int],
        num_blocks: int,
        memory_mb: int,
        method: Method = "direct",
        replicas: int = 1,
        beta: int = 1,
        segment_memory_mb: int | None = None,
        policy: str = "uniform",
    ) -> DeploymentPlan:
        """The same configuration for every function (e.g. the LambdaML baseline)."""
        return cls(
            model=model,
            platform=platform,
            segment_memory_mb=[segment_memory_mb or memory_mb] * num_blocks,
            layers=[
                LayerPlan(
                    layer=layer,
                    method=method,
                    beta=beta,
                    experts=[ExpertConfig(memory_mb=memory_mb, replicas=replicas)] * e,
                )
                for layer, e in zip(moe_layers, num_experts, strict=True)
            ],
            policy=policy,
        )
