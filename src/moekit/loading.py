"""Expert weights from Hugging Face style state dicts, sliced for tensor and expert parallelism.

Layouts read (keys under `prefix`, which ends with 'experts.' or equivalent):
  per-expert: {e}.gate_proj.weight [I, H], {e}.up_proj.weight [I, H], {e}.down_proj.weight [H, I]
              (Mixtral names w1 / w3 / w2 too), optional .bias of each;
  fused:      gate_up_proj [E, 2I, H] (or transposed [E, H, 2I]), down_proj [E, H, I] (or
              [E, I, H]), optional gate_up_proj_bias [E, 2I], down_proj_bias [E, H].
Fused shared experts (logical ids >= E) read `shared_prefix` gate/up/down_proj in the per-expert
layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from moekit.config import MoEConfig

_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass
class LoadedExperts:
    """w13 [E_local, 2I_local, H], w2 [E_local, H, I_local], b13 / b2 or None."""

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None


def tp_rows_w13(two_i: int, moe_tp_size: int, moe_tp_rank: int, interleaved: bool) -> torch.Tensor:
    """Row indices of w13 [2I, H] that moe-TP rank `moe_tp_rank` keeps (gate and up halves)."""
    I = two_i // 2
    n = I // moe_tp_size
    if interleaved:
        return torch.arange(2 * n * moe_tp_rank, 2 * n * (moe_tp_rank + 1))
    cols = torch.arange(n * moe_tp_rank, n * (moe_tp_rank + 1))
    return torch.cat([cols, cols + I])


def _missing(key: str, state_dict: Mapping[str, torch.Tensor]) -> KeyError:
    near = [k for k in state_dict if k.rsplit(".", 2)[0] in key][:5]
    return KeyError(f"state dict has no {key!r}" + (f"; keys near it: {near}" if near else ""))


def _check_shape(sd, key: str, shape: tuple[int, ...]) -> None:
    """ValueError unless sd[key] has `shape` (the config's)."""
    if tuple(sd[key].shape) != shape:
        raise ValueError(
            f"{key} has shape {list(sd[key].shape)}; the config gives {list(shape)} (H = "
            "hidden_size, I = intermediate_size)"
        )


def _per_expert(sd, prefix: str, e: int, names: tuple[str, str, str], H: int, I: int):
    g, u, d = (prefix + f"{e}.{n}" for n in names)
    for key in (g + ".weight", u + ".weight", d + ".weight"):
        if key not in sd:
            raise _missing(key, sd)
    for key, shape in ((g, (I, H)), (u, (I, H)), (d, (H, I))):
        _check_shape(sd, key + ".weight", shape)
        if key + ".bias" in sd:
            _check_shape(sd, key + ".bias", shape[:1])
    w13 = torch.cat([sd[g + ".weight"], sd[u + ".weight"]], dim=0)
    b13 = None
    if g + ".bias" in sd:
        b13 = torch.cat([sd[g + ".bias"], sd[u + ".bias"]], dim=0)
    return w13, sd[d + ".weight"], b13, sd.get(d + ".bias")


def _shared(sd, shared_prefix: str, j: int, I: int):
    """Shared expert j as a routed expert of intermediate size I. A checkpoint stores S shared
    experts as one MLP of intermediate size S * I; its slice j is exactly expert j."""
    g, u, d = (shared_prefix + n for n in _PER_EXPERT_NAMES[0])
    if g + ".weight" not in sd:
        raise _missing(g + ".weight", sd)
    part = slice(j * I, (j + 1) * I)
    w13 = torch.cat([sd[g + ".weight"][part], sd[u + ".weight"][part]], dim=0)
    b13 = None
    if g + ".bias" in sd:
        b13 = torch.cat([sd[g + ".bias"][part], sd[u + ".bias"][part]], dim=0)
    b2 = sd.get(d + ".bias")
    if b2 is not None and j > 0:
        b2 = torch.zeros_like(b2)
    return w13, sd[d + ".weight"][:, part], b13, b2


def _fused(sd, prefix: str, config: MoEConfig):
    H, I = config.hidden_size, config.intermediate_size
    gate_up, down = sd[prefix + "gate_up_proj"], sd[prefix + "down_proj"]
    E = config.num_experts
    if tuple(down.shape) == (E, H, I):
        pass
    elif tuple(down.shape) == (E, I, H):
        down = down.transpose(1, 2)
        gate_up = gate_up.transpose(1, 2)
    else:
        raise ValueError(
            f"{prefix}down_proj has shape {list(down.shape)}; expected [E, H, I] = "
            f"[{E}, {H}, {I}] or [E, I, H]"
        )
    if tuple(gate_up.shape) != (E, 2 * I, H):
        raise ValueError(
            f"{prefix}gate_up_proj has shape {list(gate_up.shape)} (after layout detection); "
            f"expected [E, 2I, H] = [{E}, {2 * I}, {H}]"
        )
    return gate_up, down, sd.get(prefix + "gate_up_proj_bias"), sd.get(prefix + "down_proj_bias")


def load_hf_experts(
    state_dict: Mapping[str, torch.Tensor],
    config: MoEConfig,
    experts: Sequence[int],
    *,
    prefix: str = "experts.",
    shared_prefix: str = "shared_experts.",
    moe_tp_size: int = 1,
    moe_tp_rank: int = 0,
) -> LoadedExperts:
    """Gather the experts `experts` (logical ids, one per local slot) from `state_dict`.

    I is sliced for moe-TP rank `moe_tp_rank` of `moe_tp_size`. The down-projection bias is
    added once per token, so only moe-TP rank 0 keeps it; other ranks get zeros (their partial
    outputs are summed)."""
    I = config.intermediate_size
    if I % moe_tp_size:
        raise ValueError(f"intermediate size {I} is not divisible by moe_tp_size {moe_tp_size}")
    fused = prefix + "gate_up_proj" in state_dict
    fused_all = _fused(state_dict, prefix, config) if fused else None
    names = next(
        (n for n in _PER_EXPERT_NAMES if f"{prefix}0.{n[0]}.weight" in state_dict),
        _PER_EXPERT_NAMES[0],
    )
    rows = tp_rows_w13(2 * I, moe_tp_size, moe_tp_rank, config.interleaved)
    n = I // moe_tp_size
    cols = slice(n * moe_tp_rank, n * (moe_tp_rank + 1))
    w13s, w2s, b13s, b2s = [], [], [], []
    for e in experts:
        if e >= config.num_experts:
            w13, w2, b13, b2 = _shared(state_dict, shared_prefix, e - config.num_experts, I)
        elif fused_all is not None:
            w13, w2, b13, b2 = (None if t is None else t[e] for t in fused_all)
        else:
            w13, w2, b13, b2 = _per_expert(state_dict, prefix, e, names, config.hidden_size, I)
        w13s.append(w13[rows])
        w2s.append(w2[:, cols])
        b13s.append(None if b13 is None else b13[rows])
        b2s.append(None if b2 is None else (b2 if moe_tp_rank == 0 else torch.zeros_like(b2)))
    stack = lambda ts: None if any(t is None for t in ts) else torch.stack(ts)  # noqa: E731
    return LoadedExperts(torch.stack(w13s), torch.stack(w2s), stack(b13s), stack(b2s))
