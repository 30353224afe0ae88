"""Which path attention takes through the KV cache: the option, its check, its meaning.

Kept apart from :mod:`moefleet.models.paged` (which imports transformers and
FlexAttention) so that option parsing stays light. ``gather`` copies each row's history
out of the cache; ``paged`` runs FlexAttention over the cache's blocks in place; ``auto``
is ``paged`` on CUDA and ``gather`` elsewhere (on the CPU eager FlexAttention scans the
whole cache, so paged there is for correctness tests only), and ``gather`` for models that
cache a latent their attention expands per cached slot (DeepSeek-V2's MLA), since paged
would expand every slot of the cache in every layer.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
from torch import nn

from moefleet.errors import MoefleetError

AttentionPath = Literal["gather", "paged"]
AttentionChoice = Literal["gather", "paged", "auto"]
ATTENTION_PATHS: tuple[AttentionPath, ...] = ("gather", "paged")
ATTENTION_CHOICES: tuple[AttentionChoice, ...] = ("gather", "paged", "auto")


def check_attention(choice: str) -> AttentionChoice:
    """``choice`` if it names an attention path, else a one-line error naming them."""
    if choice not in ATTENTION_CHOICES:
        raise MoefleetError(f"unknown attention {choice!r}",
                            f"use one of {', '.join(ATTENTION_CHOICES)}")
    return choice


def resolve_attention(choice: str, device: torch.device | str,
                      latent_cache: bool = False) -> AttentionPath:
    """The path ``choice`` means on ``device`` (see the module docstring)."""
    choice = check_attention(choice)
    if choice != "auto":
        return choice
    return "paged" if torch.device(device).type == "cuda" and not latent_cache else "gather"


def with_implementation(module: nn.Module, impl: str) -> nn.Module:
    """A shallow copy of an HF attention module that dispatches to the attention function
    registered as ``impl``.

    The copy shares the module's parameters and submodules (the same dicts, so moving
    the model moves them too); only its ``config`` is a copy naming ``impl``, so the
    original module and config keep their own attention (and the masks the model builds
    stay those of its own implementation)."""
    swapped = copy.copy(module)
    config = copy.copy(getattr(module, "config"))  # noqa: B009 - HF modules keep config
    # set the stored field, not the property: the setter would recurse into sub-configs
    # shared with the original
    config._attn_implementation_internal = impl
    object.__setattr__(swapped, "config", config)
    return swapped
