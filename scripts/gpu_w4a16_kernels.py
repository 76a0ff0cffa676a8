"""The `w4a16` runner's two kernels timed alone at each K split (1, 2, 4 warps of a block on
K) and segment width (8 or 16 pairs), and the whole call with the runner's own plan, on
qwen3-30b-a3b and gpt-oss-120b mxfp4 at T = 1, 4, 16 (H100 numbers: benchmarks/w4a16_notes.md).

    PYTHONPATH=src python3 scripts/gpu_w4a16_kernels.py
"""
import torch

from moekit.bench import time_ms
from moekit.hardware import sm_count
from moekit.quant import make_spec, quantize_experts
from moekit.runners.w4a16 import W4A16Runner, jit
from moekit.tune import random_weights, shape_for, uniform_topk

dev = torch.device("cuda")
for model, tp in (("qwen3-30b-a3b", 1), ("gpt-oss-120b", 1)):
    shape = shape_for(model, tp, tp)
    E, K, H, I = shape.num_experts, shape.top_k, shape.hidden, shape.intermediate
    torch.manual_seed(0)
    w = quantize_experts(random_weights(shape, dev), make_spec("mxfp4"))
    r = W4A16Runner(); p = r.packed(w, shape.act.interleaved)
    for T in (1, 4, 16):
        gen = torch.Generator(device=dev).manual_seed(T)
        sets = [uniform_topk(T, E, K, dev, gen) for _ in range(8)]
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        h = torch.empty(T*K, I, device=dev, dtype=torch.bfloat16)
        out = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
        flat = [(tk.ids.to(torch.int32).contiguous().view(-1), tk.weights.float().contiguous().view(-1)) for tk in sets]
        pairs = T*K; ppe = pairs/E; sms = sm_count(dev)
        pl1 = jit.plan(0, pairs, E, I, sms, ppe); pl2 = jit.plan(1, pairs, E, H, sms, ppe)
        res = {}
        for nt in (1, 2):
            for sk in (1, 2, 4):
                how = jit.Plan(nt, sk)
                def g():
                    for ids, tw in flat:
                        jit.launch(0, p.w13, x, ids, tw, p.b13, h, K, I, how, shape.act.name, shape.act.alpha, shape.act.limit, zero_out=out)
                def d():
                    for ids, tw in flat:
                        jit.launch(1, p.w2, h, ids, tw, p.b2, out, K, H, how)
                res[(nt, sk)] = (time_ms(g, dev) * 1e3 / len(flat), time_ms(d, dev) * 1e3 / len(flat))
        def layer():
            for tk in sets:
                r.run_standard(x, tk, w, shape.act)
        lay = time_ms(layer, dev) * 1e3 / len(sets)
        print(model, "T", T, "plan", pl1, pl2, "layer", round(lay, 1),
              " ".join(f"nt{nt}/sk{sk}: {a:.1f}+{b:.1f}" for (nt, sk), (a, b) in res.items()), flush=True)
