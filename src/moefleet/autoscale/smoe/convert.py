"""One-off conversion of format-1 sMoE checkpoints (torch pickles) to format 2.

    moefleet autoscale convert-checkpoint old.pt new.safetensors

Invariant: the old file is read only by torch's ``weights_only`` unpickler
(:func:`moefleet.torch_io.load_torch_data`), which rebuilds tensors and plain containers
(dict, list, tuple, str, numbers) and refuses any other global, so nothing in the file
can run; a file that needs more than that (it was not written by ``moefleet autoscale
train``, or it was altered) is refused, never loaded with the full unpickler. That
loader had a code-execution hole before torch 2.6 (CVE-2025-32434): an older torch is
refused as well. The result is checked exactly as
:func:`~moefleet.autoscale.smoe.checkpoint.read_checkpoint` checks any file, before it
is written.

Format 1 stored the same state as format 2 in one pickled dict; fields added while
format 1 was current get the values the format-1 loader gave them when absent.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe.agent import DDPGConfig
from moefleet.autoscale.smoe.checkpoint import (
    RETRAIN,
    TrainSetup,
    encode,
    parse_meta,
    sniff,
    write_state,
)
from moefleet.autoscale.smoe.nets import ActorSpec
from moefleet.autoscale.smoe.space import ConfigSpace
from moefleet.errors import MoefleetError
from moefleet.io import check_input_file, check_output_path
from moefleet.torch_io import load_torch_data

_OPTIONAL_HISTORY = ("imitation_weight", "cpu_s", "validation")


def load_v1(path: Path) -> dict[str, Any]:
    """The pickled dict of a format-1 checkpoint, read with torch's weights_only loader."""
    st = load_torch_data(path, "format-1 checkpoint", "it was not written by moefleet "
                         f"autoscale train, or was altered: {RETRAIN}")
    if not isinstance(st, dict) or st.get("format") != 1:
        raise AutoscaleError(f"{path} is not an sMoE checkpoint of format 1", RETRAIN)
    return st


def upgrade_v1(st: dict[str, Any]) -> dict[str, Any]:
    """Format 1's dict with the defaults its loader filled in, as ``agent_state`` lays it."""
    def fields(d: Any, what: str) -> dict[str, Any]:
        if not isinstance(d, dict):
            raise AutoscaleError(f"format-1 field '{what}' is not a mapping", RETRAIN)
        return {k: tuple(v) if isinstance(v, list | tuple) else v for k, v in d.items()}

    try:
        # The format-1 loader's defaults: no GPU axis, no stay prior, no skip connection,
        # no imitation floor; rows and records written before a field existed lack it.
        setup = TrainSetup(**fields(st["setup"], "setup"))
        space = ConfigSpace(**fields(st["space"], "space"))
        spec = ActorSpec(**{"stay_prior": 0.0, "skip": False, **fields(st["spec"], "spec")})
        ddpg = DDPGConfig(**{"bc_floor": 0.0, **fields(st["ddpg"], "ddpg")})
        history = [{**dict.fromkeys(_OPTIONAL_HISTORY), **row} for row in st["history"]]
        warm = dict(st.get("warm") or {})
        if warm.get("teacher"):
            warm["teacher"] = {"expert_gpu": 0.0, "expert_memory_mb": 0, **warm["teacher"]}
        replay = []
        for row in st["replay"]:  # Transition(*row): older rows lack the later fields
            defaults = (False, True, None)
            replay.append((*row, *defaults[len(row) - 6:]) if 6 <= len(row) < 9 else row)
        return {
            **{k: st[k] for k in ("dag", "space_id", "episodes", "actor", "critic", "actor_t",
                                  "critic_t", "opt_a", "opt_c", "epsilon", "updates",
                                  "torch_rng")},
            "setup": dataclasses.asdict(setup), "space": dataclasses.asdict(space),
            "spec": dataclasses.asdict(spec), "ddpg": dataclasses.asdict(ddpg),
            "history": history, "rng": st["rng"], "replay": replay,
            "best": st.get("best"), "actor_best": st.get("actor_best"), "warm": warm,
        }
    except KeyError as err:
        raise AutoscaleError(f"format-1 field {err} is missing", RETRAIN) from None
    except (TypeError, ValueError) as err:
        raise AutoscaleError(f"a format-1 field does not fit its type ({err})",
                             RETRAIN) from None


def convert_checkpoint(old: str | Path, new: str | Path) -> Path:
    """Convert the format-1 checkpoint ``old`` to a format-2 file at ``new``."""
    src = check_input_file(old, "checkpoint", "pass a format-1 sMoE checkpoint (.pt)")
    check_output_path(new, "converted checkpoint")
    if Path(new).expanduser().resolve() == src.resolve():
        raise AutoscaleError(f"converting {src} onto itself", "write the new file elsewhere")
    with open(src, "rb") as fh:
        kind = sniff(fh.read(16))
    if kind == "safetensors":
        raise AutoscaleError(f"{src} is already a format-2 checkpoint", "nothing to convert")
    if kind != "pickle":
        raise AutoscaleError(f"{src} is not an sMoE checkpoint of format 1", RETRAIN)
    try:
        state = upgrade_v1(load_v1(src))
        tensors, text = encode(state)
        parse_meta(text, f"{src} converted")
    except MoefleetError as err:
        msg = err.message if str(src) in err.message else f"{src}: {err.message}"
        raise AutoscaleError(msg, err.hint) from None
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise AutoscaleError(f"{src}: tensor '{name}' holds NaN or infinite values",
                                 "use an earlier checkpoint or retrain")
    return write_state(new, state)
