"""Standalone expert modules.

Hugging Face (v5) stores a layer's experts stacked: ``gate_up_proj[E, 2F, D]`` and
``down_proj[E, D, F]``. One expert is the slice ``e`` of both; ``GatedExpert`` holds such
a slice as its own parameters so it can be shipped to another process or function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moefleet.models.cpu_bf16 import linear


class GatedExpert(nn.Module):
    """y = down(act(gate(x)) * up(x)); gate and up fused as ``gate_up[2F, D]``."""

    def __init__(
        self,
        gate_up_2FD: torch.Tensor,
        down_DF: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(gate_up_2FD, requires_grad=False)
        self.down = nn.Parameter(down_DF, requires_grad=False)
        self.act = act

    @property
    def intermediate_size(self) -> int:
        return int(self.down.shape[1])

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        # cpu_bf16.linear: plain F.linear except bf16 on CPUs without bf16 units
        gate_NF, up_NF = linear(x_ND, self.gate_up).chunk(2, dim=-1)
        return linear(self.act(gate_NF) * up_NF, self.down)

    @classmethod
    def from_stacked(cls, experts: Any, index: int, copy: bool) -> GatedExpert:
        """Slice expert ``index`` out of an HF fused-experts module."""
        gate_up = experts.gate_up_proj[index].detach()
        down = experts.down_proj[index].detach()
        if copy:
            gate_up, down = gate_up.clone(), down.clone()
        return cls(gate_up, down, experts.act_fn)
