"""The tensors of one MoE layer in a Hugging Face checkpoint directory, read lazily.

A checkpoint directory holds config.json and its weights as safetensors: `model.safetensors`, or
shards listed by `model.safetensors.index.json`. `CheckpointFiles` opens them by tensor name and
reads only what is asked for, so a rank of a 1 TB model reads its own experts of one layer.
`CheckpointFiles.of` keeps the last directories opened, so that building every layer of a model
parses its index once. `moe_layers` lists the layers that hold experts; `layer_prefix` finds
where a layer's MoE block lives among the names ('model.layers.3.mlp.',
'model.layers.3.block_sparse_moe.', 'language_model.model.layers.3.mlp.', ...), and
`layer_tensors` reads the block's tensors that a rank holding some experts needs: of fused expert
tensors ([E, ...]: gpt-oss, Llama 4), only those experts' rows.
`MoE.from_pretrained` puts them together. Needs the `safetensors` package (moekit[hf]).
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from pathlib import Path
from typing import Collection, Sequence

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_EXPERT = re.compile(r"experts\.(\d+)\.")
_FUSED = re.compile(r"experts\.\D")  # experts.gate_up_proj, experts.down_proj_blocks, ...


class CheckpointFiles:
    """The tensors of a safetensors checkpoint by name (`names`, sorted), read on demand
    (`read`)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index, single = self.directory / INDEX, self.directory / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{index}: not a safetensors index (weight_map): {err}") from err
            self.file_of: dict[str, str] = dict(weight_map)
        elif single.is_file():
            self.file_of = {name: SINGLE for name in _open(single).keys()}
        else:
            raise FileNotFoundError(f"{self.directory}: neither {INDEX} nor {SINGLE}: not a "
                                    "safetensors checkpoint directory")  # fmt: skip
        self.names: tuple[str, ...] = tuple(sorted(self.file_of))

    @classmethod
    def of(cls, model: str | Path) -> CheckpointFiles:
        """The files of a checkpoint directory (or of the one holding `model`, its config.json),
        shared with the last calls that opened it while its index (or its single file) has not
        changed since."""
        directory = Path(model).resolve()
        directory = directory.parent if directory.is_file() else directory
        listing = directory / INDEX if (directory / INDEX).is_file() else directory / SINGLE
        stat = listing.stat() if listing.is_file() else None
        return _opened(directory, stat and (stat.st_mtime_ns, stat.st_size))

    def names_under(self, prefix: str) -> tuple[str, ...]:
        """The names that start with `prefix`, sorted."""
        start = bisect.bisect_left(self.names, prefix)
        stop = start
        while stop < len(self.names) and self.names[stop].startswith(prefix):
            stop += 1
        return self.names[start:stop]

    @functools.cached_property
    def expert_prefixes(self) -> dict[int, set[str]]:
        """{layer: the prefixes before 'experts.' of its expert tensors' names}."""
        return _expert_prefixes(self.names)

    def read(self, names: Collection[str], rows: Sequence[int] = (),
             rows_of: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
        """{name: tensor} (on the CPU) of `names`, each shard opened once. Of a tensor whose
        first dimension is `rows_of` long, only `rows` (ascending) are read, in that order."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of[name], []).append(name)
        out = {}
        for file, wanted in sorted(by_file.items()):
            path = self.directory / file
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {INDEX} for {wanted[0]!r} but missing")
            handle = _open(path)
            for name in wanted:
                part = handle.get_slice(name) if rows_of else None
                if part is not None and list(part.get_shape()[:1]) == [rows_of]:
                    out[name] = _read_rows(part, rows)
                else:
                    out[name] = handle.get_tensor(name)
        return out


@functools.lru_cache(maxsize=2)
def _opened(directory: Path, stamp: tuple[int, int] | None) -> CheckpointFiles:
    return CheckpointFiles(directory)


def _read_rows(part, rows: Sequence[int]) -> torch.Tensor:
    """Rows `rows` (ascending) of a safetensors slice, one read per run of consecutive rows."""
    runs: list[list[int]] = []  # [start, stop)
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1][1] += 1
        else:
            runs.append([row, row + 1])
    pieces = [part[start:stop] for start, stop in runs] or [part[0:0]]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _open(path: Path):
    try:
        from safetensors import safe_open
    except ImportError as err:
        raise ImportError("reading a checkpoint directory needs the safetensors package "
                          "(pip install 'moekit[hf]')") from err  # fmt: skip
    return safe_open(str(path), framework="pt", device="cpu")


_LAYER_EXPERTS = re.compile(r"^(.*?(?:^|\.)layers\.(\d+)\.(?:.*?\.)?)experts\.")


def _expert_prefixes(names: Collection[str]) -> dict[int, set[str]]:
    """{layer: the prefixes before 'experts.' of its expert tensors' names}."""
    prefixes: dict[int, set[str]] = {}
    for name in names:
        m = _LAYER_EXPERTS.match(name)
        if m:
            prefixes.setdefault(int(m.group(2)), set()).add(m.group(1))
    return prefixes


def moe_layers(model: str | Path) -> list[int]:
    """The layers of a checkpoint directory (or its config.json) that hold experts, ascending:
    the `layer`s `MoE.from_pretrained` takes (dense layers, such as DeepSeek-V3's first three,
    are not among them)."""
    return sorted(CheckpointFiles.of(model).expert_prefixes)


def layer_prefix(names: Collection[str] | CheckpointFiles, layer: int) -> str:
    """The prefix of layer `layer`'s MoE block among tensor names (or a checkpoint's): the text
    before 'experts.' in the names of its expert tensors (e.g. 'model.layers.3.mlp.').
    ValueError naming the layers that have experts when this one has none (a dense layer, or
    past the last)."""
    prefixes = (names.expert_prefixes if isinstance(names, CheckpointFiles) else
                _expert_prefixes(names))  # fmt: skip
    if layer not in prefixes:
        have = sorted(prefixes)
        shown = (f"{len(have)}, {have[0]} to {have[-1]}" if len(have) > 1 else
                 str(have[0]) if have else "none")  # fmt: skip
        raise ValueError(f"layer {layer} has no expert tensors in the checkpoint; layers with "
                         f"experts: {shown}")  # fmt: skip
    if len(prefixes[layer]) > 1:
        raise ValueError(f"layer {layer}: expert tensors under several prefixes "
                         f"{sorted(prefixes[layer])}; pass the prefix")  # fmt: skip
    return next(iter(prefixes[layer]))


def layer_tensors(files: CheckpointFiles, prefix: str, experts: Collection[int],
                  num_experts: int, shared: bool = False,
                  ) -> tuple[dict[str, torch.Tensor], list[int]]:  # fmt: skip
    """The tensors under `prefix` that a rank holding the logical `experts` (of `num_experts`
    routed ones; ids past them are shared experts) reads, and the experts whose rows the fused
    tensors hold (ascending). Read: the experts' own in the per-expert layout (`experts.{e}.*`),
    their rows of the fused expert tensors, the block's other tensors (the router's correction
    bias, ...), and the shared experts' only when `shared`."""
    local = set(experts)
    per_expert, fused = [], []
    for name in files.names_under(prefix):
        rest = name[len(prefix):]
        m = _EXPERT.match(rest)
        other_expert = m is not None and int(m.group(1)) not in local
        if other_expert or (rest.startswith("shared_expert") and not shared):
            continue
        (fused if _FUSED.match(rest) else per_expert).append(name)
    rows = sorted(e for e in local if e < num_experts)
    return {**files.read(per_expert), **files.read(fused, rows, num_experts)}, rows
