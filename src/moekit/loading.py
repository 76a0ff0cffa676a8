"""Expert weights from Hugging Face style state dicts, sliced for tensor and expert parallelism.

Layouts read (keys under `prefix`, which ends with 'experts.' or equivalent):
  per-expert: {e}.gate_proj.weight [I, H], {e}.up_proj.weight [I, H], {e}.down_proj.weight [H, I]
              (Mixtral names w1 / w3 / w2 too), optional .bias of each;
  fused:      gate_up_proj [E, 2I, H] (or transposed [E, H, 2I]), down_proj [E, H, I] (or
              [E, I, H]), optional gate_up_proj_bias [E, 2I], down_proj_bias [E, H].
Fused shared experts (logical ids >= E) read `shared_prefix` gate/up/down_proj in the per-expert
layout.

Quantized checkpoints load as they are stored, without requantizing: per-expert weights in the
conventions of `moekit.quant.loaders.load_weight` (fp8 with `weight_scale_inv` / `weight_scale`
and an optional static `input_scale`, int8, GPTQ, AWQ, compressed-tensors pack-quantized,
nvfp4), gpt-oss's fused mxfp4 `gate_up_proj_blocks` / `_scales` and `down_proj_blocks` /
`_scales`, and fused fp8 `gate_up_proj` / `down_proj` [E, N, K] with `_scale_inv` (or `_scale`)
beside each. A tensor-parallel cut must fall on the format's scale groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import torch

from moekit.config import MoEConfig
from moekit.experts import ExpertWeights
from moekit.quant import loaders
from moekit.quant.checkpoint import CheckpointFormat
from moekit.quant.expert_weights import from_quantized
from moekit.quant.quantize import QuantizedTensor
from moekit.quant.spec import FP8_DTYPE, QuantSpec

# One weight [.., N, K] as a state dict holds it: plain, or quantized (logical shape).
Weight = Union[torch.Tensor, QuantizedTensor]

_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass
class LoadedExperts:
    """w13 [E_local, 2I_local, H], w2 [E_local, H, I_local] (QuantizedTensors of that logical
    shape from a quantized checkpoint), b13 / b2 or None, and a13_scale / a2_scale [E_local]
    float32: the static activation scales of an fp8 checkpoint's `input_scale`s, or None."""

    w13: Weight
    w2: Weight
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None

    @property
    def spec(self) -> QuantSpec | None:
        """The quantized format, None for plain tensors."""
        return self.w13.spec if isinstance(self.w13, QuantizedTensor) else None

    def quantized(self) -> ExpertWeights:
        """The quantized experts as ExpertWeights (with their static scales; no biases)."""
        if self.spec is None:
            raise ValueError("LoadedExperts.quantized: the state dict's experts are unquantized")
        return from_quantized(self.w13, self.w2, a13_scale=self.a13_scale,
                              a2_scale=self.a2_scale)  # fmt: skip


def _rows(w: Weight, start: int, length: int, dim: int = -2) -> Weight:
    """Rows [start, start + length) of w [.., N, K] (of a bias [.., N]: dim -1)."""
    if isinstance(w, QuantizedTensor):
        return loaders.narrow(w, -2, start, length)
    return w.narrow(dim, start, length)


def _cols(w: Weight, start: int, length: int) -> Weight:
    """Columns [start, start + length) of w [.., N, K]."""
    if isinstance(w, QuantizedTensor):
        return loaders.narrow(w, -1, start, length)
    return w.narrow(-1, start, length)


def _cat_rows(parts: Sequence[Weight], dim: int = -2) -> Weight:
    if len({isinstance(p, QuantizedTensor) for p in parts}) > 1:
        raise ValueError("an expert's gate_proj and up_proj must share one format; the state "
                         "dict has one quantized and one not")  # fmt: skip
    if isinstance(parts[0], QuantizedTensor):
        return loaders.cat_rows(parts)
    return torch.cat(list(parts), dim=dim)


def _stack(parts: Sequence[Weight | None]) -> Weight | None:
    if any(p is None for p in parts):
        return None
    if isinstance(parts[0], QuantizedTensor):
        return loaders.stack(parts)
    return torch.stack(list(parts))


def _tp_share_w13(w13: Weight, moe_tp_size: int, moe_tp_rank: int, interleaved: bool,
                 dim: int = -2) -> Weight:  # fmt: skip
    """The rows of w13 [.., 2I, H] (of b13 [.., 2I]: dim -1) that moe-TP rank `moe_tp_rank`
    keeps: its share of the gate rows and of the up rows (interleaved: one block of alternating
    gate / up rows)."""
    I = w13.shape[dim] // 2
    n = I // moe_tp_size
    if interleaved:
        return _rows(w13, 2 * n * moe_tp_rank, 2 * n, dim)
    if moe_tp_size == 1:
        return w13
    return _cat_rows([_rows(w13, n * moe_tp_rank, n, dim), _rows(w13, I + n * moe_tp_rank, n, dim)],
                     dim)  # fmt: skip


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


def _weight(sd, name: str, shape: tuple[int, int],
            options: dict) -> tuple[Weight, torch.Tensor | None]:  # fmt: skip
    """Weight `name` (e.g. 'experts.3.gate_proj') as stored, checked against the config's
    [N, K], and its fp8 static activation scale (or None). options: of loaders.load_weight."""
    quantized = loaders.load_weight(sd, name, **options)
    if quantized is None:
        if name + ".weight" not in sd:
            raise _missing(name + ".weight", sd)
        _check_shape(sd, name + ".weight", shape)
        return sd[name + ".weight"], None
    w, input_scale = quantized
    if tuple(w.shape) != shape:
        raise ValueError(
            f"{name} holds a {w.spec.describe()} weight of shape {list(w.shape)}; the config "
            f"gives {list(shape)} (H = hidden_size, I = intermediate_size)"
        )
    return w, input_scale


def _a13(name: str, gate: torch.Tensor | None, up: torch.Tensor | None) -> torch.Tensor | None:
    """One static scale for x, which gate and up both read: the larger of theirs."""
    if (gate is None) != (up is None):
        raise ValueError(f"{name}: gate_proj and up_proj must both have input_scale or neither")
    return None if gate is None else torch.maximum(gate, up)


def _per_expert(sd, prefix: str, e: int, names: tuple[str, str, str], H: int, I: int,
                options: dict):  # fmt: skip
    g, u, d = (prefix + f"{e}.{n}" for n in names)
    (wg, s_gate), (wu, s_up), (wd, s_down) = (
        _weight(sd, g, (I, H), options), _weight(sd, u, (I, H), options),
        _weight(sd, d, (H, I), options),
    )  # fmt: skip
    for key, n in ((g, I), (u, I), (d, H)):
        if key + ".bias" in sd:
            _check_shape(sd, key + ".bias", (n,))
    b13 = None
    if g + ".bias" in sd:
        b13 = torch.cat([sd[g + ".bias"], sd[u + ".bias"]], dim=0)
    a13 = _a13(g, s_gate, s_up)
    return _cat_rows([wg, wu]), wd, b13, sd.get(d + ".bias"), a13, s_down


def _shared(sd, shared_prefix: str, j: int, S: int, I: int, H: int, options: dict):
    """Shared expert j as a routed expert of intermediate size I. A checkpoint stores S shared
    experts as one MLP of intermediate size S * I; its slice j is exactly expert j."""
    g, u, d = (shared_prefix + n for n in _PER_EXPERT_NAMES[0])
    (wg, s_gate), (wu, s_up), (wd, s_down) = (
        _weight(sd, g, (S * I, H), options), _weight(sd, u, (S * I, H), options),
        _weight(sd, d, (H, S * I), options),
    )  # fmt: skip
    part = slice(j * I, (j + 1) * I)
    b13 = None
    if g + ".bias" in sd:
        b13 = torch.cat([sd[g + ".bias"][part], sd[u + ".bias"][part]], dim=0)
    b2 = sd.get(d + ".bias")
    if b2 is not None and j > 0:
        b2 = torch.zeros_like(b2)
    a13 = _a13(g, s_gate, s_up)
    w13 = _cat_rows([_rows(wg, j * I, I), _rows(wu, j * I, I)])
    return w13, _cols(wd, j * I, I), b13, b2, a13, s_down


def _fused_mxfp4(sd, prefix: str) -> tuple[Weight, Weight]:
    """gpt-oss's mxfp4 gate_up_proj_blocks / _scales and down_proj_blocks / _scales."""
    for key in ("gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"):
        if prefix + key not in sd:
            raise _missing(prefix + key, sd)
    return (
        loaders.load_mxfp4_blocks(sd[prefix + "gate_up_proj_blocks"],
                                  sd[prefix + "gate_up_proj_scales"]),
        loaders.load_mxfp4_blocks(sd[prefix + "down_proj_blocks"], sd[prefix + "down_proj_scales"]),
    )  # fmt: skip


def _fused_fp8(sd, key: str, options: dict) -> Weight:
    """A fused fp8 weight [E, N, K] and its `{key}_scale_inv` or `{key}_scale` (transformers'
    fp8 experts); options: of loaders.load_weight."""
    scale = sd.get(key + "_scale_inv", sd.get(key + "_scale"))
    if scale is None:
        raise _missing(key + "_scale_inv", sd)
    return loaders.load_fp8(sd[key], scale, activation_scheme=options.get("fp8_activation_scheme"))


def _fused(sd, prefix: str, config: MoEConfig, options: dict, E: int):
    """The fused expert tensors under `prefix`, of `E` experts: gate_up [E, 2I, H], down
    [E, H, I] (quantized where stored so) and their biases [E, 2I] / [E, H] or None."""
    H, I = config.hidden_size, config.intermediate_size
    if prefix + "gate_up_proj_blocks" in sd:
        gate_up, down = _fused_mxfp4(sd, prefix)
    elif sd[prefix + "gate_up_proj"].dtype == FP8_DTYPE:
        gate_up, down = (_fused_fp8(sd, prefix + n, options) for n in ("gate_up_proj",
                                                                          "down_proj"))
    else:
        gate_up, down = sd[prefix + "gate_up_proj"], sd[prefix + "down_proj"]
        if tuple(down.shape) == (E, I, H) and tuple(down.shape) != (E, H, I):
            down = down.transpose(1, 2)
            gate_up = gate_up.transpose(1, 2)
    if tuple(down.shape) != (E, H, I):
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


def _one_kind(what: str, ts: Sequence[object], kind) -> None:
    """ValueError unless all or none of the experts' `what` are `kind` (None: present)."""
    has = [t is not None if kind is None else isinstance(t, kind) for t in ts]
    if any(has) and not all(has):
        raise ValueError(
            f"the state dict's experts mix {what} with experts without: expert slots "
            f"{[i for i, h in enumerate(has) if h][:8]} have it, {has.count(False)} do not"
        )


def load_hf_experts(
    state_dict: Mapping[str, torch.Tensor],
    config: MoEConfig,
    experts: Sequence[int],
    *,
    prefix: str = "experts.",
    shared_prefix: str = "shared_experts.",
    moe_tp_size: int = 1,
    moe_tp_rank: int = 0,
    checkpoint: CheckpointFormat | None = None,
    fused_experts: Sequence[int] | None = None,
) -> LoadedExperts:
    """Gather the experts `experts` (logical ids, one per local slot) from `state_dict`.

    I is sliced for moe-TP rank `moe_tp_rank` of `moe_tp_size`. The down-projection bias is
    added once per token, so only moe-TP rank 0 keeps it; other ranks get zeros (their partial
    outputs are summed). Quantized experts stay quantized (module docstring). `checkpoint`: the
    format the checkpoint's config declares (`moekit.quant.checkpoint`); what it says the tensors
    cannot (GPTQ zero offset, fp8 activation scheme, weight-only int8) is read, and the experts
    must load in its format. `fused_experts`: the logical experts whose rows fused expert tensors
    hold, in order, when they hold only some (a rank's rows read from a checkpoint); default all."""
    I, H = config.intermediate_size, config.hidden_size
    if I % moe_tp_size:
        raise ValueError(f"intermediate size {I} is not divisible by moe_tp_size {moe_tp_size}")
    fused = any(prefix + k in state_dict for k in ("gate_up_proj", "gate_up_proj_blocks"))
    options = {} if checkpoint is None else checkpoint.load_options()
    rows = range(config.num_experts) if fused_experts is None else fused_experts
    row_of = {e: i for i, e in enumerate(rows)}
    fused_all = _fused(state_dict, prefix, config, options, len(rows)) if fused else None
    # the per-expert naming, read off one expert this rank holds (an EP rank may lack expert 0)
    probe = next((e for e in experts if e < config.num_experts), 0)
    names = next(
        (n for n in _PER_EXPERT_NAMES
         if any(f"{prefix}{probe}.{n[0]}{s}" in state_dict
                for s in loaders.STORED_WEIGHT_SUFFIXES)),
        _PER_EXPERT_NAMES[0],
    )  # fmt: skip
    n = I // moe_tp_size
    got: list[tuple] = []
    for e in experts:
        if e >= config.num_experts:
            w13, w2, b13, b2, a13, a2 = _shared(state_dict, shared_prefix, e - config.num_experts,
                                                config.num_shared_experts, I, H,
                                                options)  # fmt: skip
        elif fused_all is not None:
            if e not in row_of:
                raise ValueError(f"expert {e} is not among fused_experts, the "
                                 f"{len(rows)} experts the fused tensors hold")  # fmt: skip
            w13, w2, b13, b2 = (t if t is None else t[row_of[e]] for t in fused_all)
            a13 = a2 = None
        else:
            w13, w2, b13, b2, a13, a2 = _per_expert(state_dict, prefix, e, names, H, I, options)
        if b2 is not None and moe_tp_rank != 0:
            b2 = torch.zeros_like(b2)
        got.append((
            _tp_share_w13(w13, moe_tp_size, moe_tp_rank, config.interleaved),
            _cols(w2, n * moe_tp_rank, n),
            None if b13 is None else _tp_share_w13(b13, moe_tp_size, moe_tp_rank,
                                                  config.interleaved, dim=-1),
            b2, a13, a2,
        ))  # fmt: skip
    w13s, w2s, b13s, b2s, a13s, a2s = zip(*got)
    _one_kind("quantized weights", w13s, QuantizedTensor)
    _one_kind("an input_scale", a13s, None)
    loaded = LoadedExperts(*(_stack(ts) for ts in (w13s, w2s, b13s, b2s, a13s, a2s)))
    if checkpoint is not None:
        checkpoint.check(loaded.spec, f"the experts under {prefix!r}")
    return loaded
