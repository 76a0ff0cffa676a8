"""A transformers model's forward with its experts on transformers' own implementations and on
moekit (`moekit.integrations.hf`), timed in turns.

Two-layer models with the MoE layers of qwen3-30b-a3b and gpt-oss-120b (random weights, bf16,
small vocabulary): the whole forward (attention, norms, router, experts) of B x S tokens,
without CUDA graphs (as `model(ids)` runs), for experts_implementation = eager, grouped_mm
(transformers' default) and moekit; the logits of each against grouped_mm's.

    PYTHONPATH=src python3 scripts/gpu_probe_hf_experts.py [--shapes '1x1;1x128;4x1024;8x2048']
        [--rounds 5] [--samples 25] [--compile]

--compile: grouped_mm and moekit, each also under torch.compile(mode="reduce-overhead",
fullgraph=True, dynamic=False) (Inductor and CUDA graphs; moekit's experts as one custom op),
instead of the three eager implementations.

Writes $OUT/hf_experts.json.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit.bench import time_ms_interleaved
from moekit.integrations import hf

IMPLS = ("eager", "grouped_mm", "moekit")


def models():
    """(name, model) built on the GPU in bf16, one at a time."""
    import transformers as tf

    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    common = dict(num_hidden_layers=2, vocab_size=1024, max_position_embeddings=8192)
    yield "qwen3-30b-a3b", tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **common, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128))
    yield "gpt-oss-120b", tf.GptOssForCausalLM(tf.GptOssConfig(
        **common, hidden_size=2880, intermediate_size=2880, num_local_experts=128,
        num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64))


def time_model(name: str, model, shapes, rounds: int, samples: int, compile_: bool) -> list[dict]:
    """The forward of `model` on each B x S under each experts implementation, in turns."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "gate_up_proj")}
    impls = ("grouped_mm", "moekit") if compile_ else IMPLS
    for impl in impls:
        model.set_experts_implementation(impl)  # checks the name once; the calls below switch
    points = []  # by the flag the experts modules read at every call
    compiled = None
    if compile_:
        torch._dynamo.reset()
        torch._dynamo.config.cache_size_limit = 64
        compiled = torch.compile(hf.prepare(model), mode="reduce-overhead", fullgraph=True,
                                 dynamic=False)  # fmt: skip
    for B, S in shapes:
        ids = torch.randint(0, 1024, (B, S), device="cuda")
        outs = {}

        def run(impl, ids=ids, outs=outs, fn=model, tag=""):
            for cfg in configs.values():
                cfg._experts_implementation = impl
            with torch.no_grad():
                outs[impl + tag] = fn(ids).logits.clone()  # (a graph's output is reused)

        fns = {impl: (lambda impl=impl: run(impl)) for impl in impls}
        if compiled is not None:
            for impl in impls:
                fns[impl + "+compiled"] = lambda impl=impl: run(impl, fn=compiled, tag="+compiled")
                for _ in range(3):  # compile and record outside the timing
                    fns[impl + "+compiled"]()
        ms = time_ms_interleaved(fns, "cuda", cuda_graph=False, rounds=rounds, samples=samples,
                                 min_sample_ms=20.0)  # fmt: skip
        for fn in fns.values():  # each output fresh (a CUDA-graph output is overwritten later)
            fn()
            torch.cuda.synchronize()
        ref = outs["grouped_mm"].float()
        diff = {i: float((outs[i].float() - ref).abs().max() / ref.abs().max()) for i in fns}
        point = {"model": name, "B": B, "S": S, "ms": {i: round(v, 3) for i, v in ms.items()},
                 "grouped_mm_over_moekit": round(ms["grouped_mm"] / ms["moekit"], 3),
                 "max_rel_diff_vs_grouped_mm": diff}  # fmt: skip
        if compiled is not None:
            point["compiled_max_rel_diff_vs_own_eager"] = {
                i: float((outs[i + "+compiled"].float() - outs[i].float()).abs().max()
                         / outs[i].float().abs().max()) for i in impls}  # fmt: skip
            point["compiled_grouped_mm_over_moekit"] = round(
                ms["grouped_mm+compiled"] / ms["moekit+compiled"], 3)
        print(point)
        points.append(point)
    return points


def main() -> None:
    spec = option("--shapes", "1x1;1x128;4x1024;8x2048")
    shapes = [tuple(map(int, s.split("x"))) for s in spec.split(";")]
    hf.register()
    res: dict = {"points": []}
    for name, model in models():
        model.eval()
        with torch.no_grad():
            for p in model.parameters():  # gpt-oss leaves its experts at zero
                if p.dim() >= 2:
                    torch.nn.init.normal_(p, std=0.02)
        res["points"] += time_model(name, model, shapes, int(option("--rounds", "5")),
                                    int(option("--samples", "25")), "--compile" in sys.argv)
        del model
        torch.cuda.empty_cache()
    write_probe("hf_experts.json", res)


if __name__ == "__main__":
    main()
