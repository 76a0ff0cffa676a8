"""The tensors of one MoE layer in a Hugging Face checkpoint directory, read lazily.

A checkpoint directory holds config.json and its weights as safetensors: `model.safetensors`, or
shards listed by `model.safetensors.index.json`. `CheckpointFiles` opens them by tensor name and
reads only what is asked for, so a rank of a 1 TB model reads its own experts of one layer.
`layer_prefix` finds where a layer's MoE block lives among the names ('model.layers.3.mlp.',
'model.layers.3.block_sparse_moe.', 'language_model.model.layers.3.mlp.', ...), and
`layer_tensors` reads the block's tensors that a rank holding some experts needs.
`MoE.from_pretrained` puts them together. Needs the `safetensors` package (moekit[hf]).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Collection, Mapping

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_EXPERT = re.compile(r"experts\.(\d+)\.")


class CheckpointFiles:
    """The tensors of a safetensors checkpoint by name (`names`), read on demand (`read`)."""

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

    @property
    def names(self) -> list[str]:
        return sorted(self.file_of)

    def read(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """{name: tensor} (on the CPU) of `names`, each shard opened once."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of[name], []).append(name)
        out = {}
        for file, wanted in sorted(by_file.items()):
            path = self.directory / file
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {INDEX} for {wanted[0]!r} but missing")
            handle = _open(path)
            out.update({name: handle.get_tensor(name) for name in wanted})
        return out


def _open(path: Path):
    try:
        from safetensors import safe_open
    except ImportError as err:
        raise ImportError("reading a checkpoint directory needs the safetensors package "
                          "(pip install 'moekit[hf]')") from err  # fmt: skip
    return safe_open(str(path), framework="pt", device="cpu")


def layer_prefix(names: Collection[str], layer: int) -> str:
    """The prefix of layer `layer`'s MoE block: the text before 'experts.' in the names of its
    expert tensors (e.g. 'model.layers.3.mlp.'). ValueError naming the layers that have experts
    when this one has none (a dense layer, or past the last)."""
    pattern = re.compile(r"^(.*?(?:^|\.)layers\.(\d+)\.(?:.*?\.)?)experts\.")
    prefixes: dict[int, set[str]] = {}
    for name in names:
        m = pattern.match(name)
        if m:
            prefixes.setdefault(int(m.group(2)), set()).add(m.group(1))
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
                  shared: bool = False) -> Mapping[str, torch.Tensor]:  # fmt: skip
    """The tensors under `prefix` that a rank holding the logical `experts` reads: theirs in the
    per-expert layout (`experts.{e}.*`), the fused expert tensors, and the block's other tensors
    (the router's correction bias, ...); the shared experts' only when `shared`."""
    local = set(experts)
    wanted = []
    for name in files.names:
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        m = _EXPERT.match(rest)
        other_expert = m is not None and int(m.group(1)) not in local
        if other_expert or (rest.startswith("shared_expert") and not shared):
            continue
        wanted.append(name)
    return files.read(wanted)
