"""Reference twin of the all-to-all dispatcher: R ranks simulated in one process with plain
Python loops (no collectives, no index tricks), for tests. Small shapes only.

It defines what each rank must receive, in which order, and what combine must return:
  normal:  rank r receives, for each source rank s in order and each token t of s in order that
           has an expert on r, the row x_s[t] with local ids (-1 elsewhere) and weights (0 where
           the id is -1); combine sums, per token, the rows each rank sends back. With chunks
           (chunk_tokens[s]: tokens per chunk of source s), the order is by chunk first: chunk
           c of every source in turn, then chunk c + 1.
  masked:  local expert e of rank r receives the pairs (s, t, k) routed to it, ordered by
           (s, t, k), as rows [e, 0..count); combine sums weight * output over the pairs.
Slots follow the dispatcher's rule: logical expert l with copies c_0 < c_1 < ... uses copy
c_{t % n} for token t (spread) or c_0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moekit.experts import ActivationSpec, ExpertWeights
from moekit.placement import ExpertPlacement
from moekit.router import TopKOutput
from moekit.runners.torch import moe_reference_fp64
from moekit.stages import MaskedDispatchOutput, StandardDispatchOutput


@dataclass
class RefNormalHandle:
    """sources[r]: (source rank, token) of each row rank r received."""

    sources: list[list[tuple[int, int]]]
    num_tokens: list[int]


@dataclass
class RefMaskedHandle:
    """pairs[r][e]: (source rank, token, weight) of each valid row of local expert e of r."""

    pairs: list[list[list[tuple[int, int, float]]]]
    num_tokens: list[int]


class ReferenceAllToAll:
    """Simulated dispatch/combine over placement.ep_size ranks (see the module docstring)."""

    def __init__(self, placement: ExpertPlacement, num_logical: int | None = None,
                 spread: bool = True) -> None:
        p2l = placement.physical_to_logical.tolist()
        self.R, self.E = placement.ep_size, placement.slots_per_rank
        self.copies: dict[int, list[int]] = {}
        for slot, logical in enumerate(p2l):
            self.copies.setdefault(int(logical), []).append(slot)
        self.spread = spread

    def slot(self, t: int, logical: int) -> int:
        """Physical slot for token t and a logical id (-1 -> -1)."""
        if logical < 0:
            return -1
        c = self.copies[logical]
        return c[t % len(c)] if self.spread else c[0]

    def physical_ids(self, topk: TopKOutput) -> torch.Tensor:
        """[T, K] int32 physical slot ids of topk (for an end-to-end reference)."""
        ids = topk.ids.tolist()
        return torch.tensor([[self.slot(t, e) for e in row] for t, row in enumerate(ids)],
                            dtype=torch.int32).reshape(topk.ids.shape)

    def local_share(self, r: int) -> float:
        """The share of uniformly routed pairs whose slot is on rank r: each logical expert
        counts 1 / L, split evenly over its copies (spread) or all on its first copy."""
        share = 0.0
        for slots in self.copies.values():
            here = [s // self.E == r for s in slots]
            share += sum(here) / len(slots) if self.spread else float(here[0])
        return share / len(self.copies)

    def _local(self, t: int, ids_row: list[int], w_row: list[float], r: int):
        ids, ws = [], []
        for e, w in zip(ids_row, w_row):
            s = self.slot(t, e)
            here = s >= 0 and s // self.E == r
            ids.append(s - r * self.E if here else -1)
            ws.append(w if here else 0.0)
        return ids, ws

    def dispatch_normal(self, xs: list[torch.Tensor], topks: list[TopKOutput],
                        chunk_tokens: list[int] | None = None):
        """-> list over ranks of StandardDispatchOutput (handle: RefNormalHandle, shared)."""
        H = xs[0].shape[1]
        handle = RefNormalHandle([[] for _ in range(self.R)], [x.shape[0] for x in xs])
        sizes = chunk_tokens or [max(1, x.shape[0]) for x in xs]
        order = sorted((t // sizes[s], s, t) for s, x in enumerate(xs) for t in range(x.shape[0]))
        outs = []
        for r in range(self.R):
            rows, ids, ws = [], [], []
            for _, s, t in order:
                id_row, w_row = topks[s].ids[t].tolist(), topks[s].weights[t].tolist()
                local, w = self._local(t, id_row, w_row, r)
                if any(i >= 0 for i in local):
                    rows.append(xs[s][t])
                    ids.append(local)
                    ws.append(w)
                    handle.sources[r].append((s, t))
            K = topks[0].ids.shape[1]
            x_r = torch.stack(rows) if rows else xs[0].new_zeros(0, H)
            topk_r = TopKOutput(torch.tensor(ws, dtype=torch.float32).reshape(-1, K),
                                torch.tensor(ids, dtype=torch.int32).reshape(-1, K))
            outs.append(StandardDispatchOutput(x_r, topk_r, handle))
        return outs

    def combine_normal(self, outs: list[torch.Tensor], handle: RefNormalHandle):
        """outs[r] [N_r, H] (weighted partial sums) -> list over ranks of [T_s, H] float64."""
        H = outs[0].shape[1]
        result = [torch.zeros(T, H, dtype=torch.float64) for T in handle.num_tokens]
        for r, out in enumerate(outs):
            for row, (s, t) in enumerate(handle.sources[r]):
                result[s][t] += out[row].double().cpu()
        return result

    def dispatch_masked(self, xs: list[torch.Tensor], topks: list[TopKOutput], capacity: int):
        """-> list over ranks of MaskedDispatchOutput, x [E, R * capacity, H] with zero padding
        (handle: RefMaskedHandle, shared), expected_rows the mean count per expert of rank r
        under uniform routing if every rank sent rank r's token count, rounded up. Raises
        ValueError when a rank has > capacity tokens."""
        H = xs[0].shape[1]
        for s, x in enumerate(xs):
            if x.shape[0] > capacity:
                raise ValueError(f"rank {s}: {x.shape[0]} tokens > capacity {capacity}")
        handle = RefMaskedHandle([[[] for _ in range(self.E)] for _ in range(self.R)],
                                 [x.shape[0] for x in xs])
        outs = []
        for r in range(self.R):
            xm = xs[0].new_zeros(self.E, self.R * capacity, H)
            for s, (x, topk) in enumerate(zip(xs, topks)):
                for t, (id_row, w_row) in enumerate(zip(topk.ids.tolist(), topk.weights.tolist())):
                    local, w = self._local(t, id_row, w_row, r)
                    for e, wk in zip(local, w):
                        if e >= 0:
                            xm[e, len(handle.pairs[r][e])] = x[t]
                            handle.pairs[r][e].append((s, t, wk))
            counts = torch.tensor([len(p) for p in handle.pairs[r]], dtype=torch.int32)
            sent = self.R * xs[r].shape[0] * topks[r].ids.shape[1]  # pairs, if all sent as r
            outs.append(MaskedDispatchOutput(xm, counts, handle,
                                             math.ceil(sent * self.local_share(r) / self.E)))
        return outs

    def combine_masked(self, outs: list[torch.Tensor], handle: RefMaskedHandle):
        """outs[r] [E, R * capacity, H] unweighted -> list over ranks of [T_s, H] float64."""
        H = outs[0].shape[2]
        result = [torch.zeros(T, H, dtype=torch.float64) for T in handle.num_tokens]
        for r, out in enumerate(outs):
            for e, pairs in enumerate(handle.pairs[r]):
                for row, (s, t, w) in enumerate(pairs):
                    result[s][t] += w * out[e, row].double().cpu()
        return result


def moe_reference_ranks(
    xs: list[torch.Tensor],
    topks: list[TopKOutput],
    placement: ExpertPlacement,
    weights: ExpertWeights,
    act: ActivationSpec,
    spread: bool = True,
) -> list[torch.Tensor]:
    """End-to-end float64 MoE output of every rank's tokens, with `weights` holding all physical
    slots [P, 2I, H] (the full I): what an EP layer must return on each rank."""
    ref = ReferenceAllToAll(placement, spread=spread)
    return [
        moe_reference_fp64(x, TopKOutput(topk.weights, ref.physical_ids(topk)), weights, act)
        for x, topk in zip(xs, topks)
    ]
