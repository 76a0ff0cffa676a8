"""One MoE layer from a checkpoint directory (`MoE.from_pretrained`, `moekit.pretrained`):
config.json and safetensors shards written here, the layer's block found by its expert tensors,
only a rank's own experts read, and the layer equal to one loaded from the whole state dict."""

import json

import pytest
import torch

from moekit import MoE, ParallelConfig, RunnerConfig
from moekit.pretrained import CheckpointFiles, layer_prefix, layer_tensors, moe_layers
from tests.test_quant_checkpoint import CT_W4A16
from tests.test_quant_loaders import ct_packed_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")

E, K, H, I = 4, 2, 256, 128
CONFIG = {
    "model_type": "deepseek_v3", "hidden_size": H, "intermediate_size": 512,
    "moe_intermediate_size": I, "n_routed_experts": E, "n_shared_experts": 1,
    "num_experts_per_tok": K, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "num_hidden_layers": 2, "quantization_config": CT_W4A16,
}  # fmt: skip
PREFIX = "model.layers.1.mlp."


def _checkpoint() -> dict[str, torch.Tensor]:
    """Layer 0 dense, layer 1 MoE with int4 experts (groups of 32), a bf16 shared expert, the
    router and its correction bias."""
    torch.manual_seed(0)
    sd = {f"model.layers.0.mlp.{n}.weight": torch.randn(512, H).bfloat16()
          for n in ("gate_proj", "up_proj")}  # fmt: skip
    sd["model.layers.0.mlp.down_proj.weight"] = torch.randn(H, 512).bfloat16()
    for e in range(E):
        for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            tensors, _ = ct_packed_checkpoint(torch.randn(shape) / 16, 4, 32)
            sd.update({f"{PREFIX}experts.{e}.{n}{k}": t for k, t in tensors.items()})
    for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        sd[f"{PREFIX}shared_experts.{n}.weight"] = torch.randn(shape).bfloat16()
    sd[PREFIX + "gate.weight"] = torch.randn(E, H).bfloat16()
    sd[PREFIX + "gate.e_score_correction_bias"] = torch.randn(E)
    return sd


def _write(directory, sd, shards=2):
    (directory / "config.json").write_text(json.dumps(CONFIG))
    names = sorted(sd)
    if shards == 1:
        safetensors_torch.save_file(sd, str(directory / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        part = {n: sd[n].contiguous() for n in names[i::shards]}
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        safetensors_torch.save_file(part, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2)])
def test_layer_equals_the_whole_state_dicts(tmp_path, shards, tp, ep):
    sd = _checkpoint()
    _write(tmp_path, sd, shards)
    parallel, run = ParallelConfig(tp_size=tp, ep_size=ep), RunnerConfig(moe_runner_backend="torch")
    x, logits = torch.randn(5, H), torch.randn(5, E)
    for rank in range(tp):
        layer = MoE.from_pretrained(tmp_path, 1, parallel, run, tp_rank=rank, dtype="float32")
        assert layer.quant_spec.name == "int4_w4a16" and layer.quant_spec.group_size == 32
        ref = MoE(layer.config, parallel, run, tp_rank=rank)
        ref.load_hf_state_dict(sd, PREFIX, quantization_config=CONFIG["quantization_config"])
        a, b = layer.expert_weights, ref.expert_weights
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            assert torch.equal(getattr(a, name), getattr(b, name))
        assert torch.equal(layer.correction_bias, sd[PREFIX + "gate.e_score_correction_bias"])
        assert torch.equal(layer(x, logits), ref(x, logits))


def _record_reads(monkeypatch) -> dict[str, torch.Size]:
    """{name: shape read} of every tensor CheckpointFiles.read returns from now on (the shape of
    what was read: a fused tensor's rows when only rows are)."""
    shapes: dict[str, torch.Size] = {}
    original = CheckpointFiles.read

    def read(self, *args):
        out = original(self, *args)
        shapes.update({name: t.shape for name, t in out.items()})
        return out

    monkeypatch.setattr(CheckpointFiles, "read", read)
    return shapes


def test_a_rank_reads_only_its_experts(tmp_path, monkeypatch):
    _write(tmp_path, _checkpoint(), 2)
    read = _record_reads(monkeypatch)
    MoE.from_pretrained(tmp_path / "config.json", 1, ParallelConfig(tp_size=2, ep_size=2),
                        tp_rank=1, dtype="float32")  # fmt: skip
    experts = {n.split(".")[5] for n in read if ".experts." in n}
    assert experts == {"2", "3"}  # rank 1 of EP2 holds experts 2 and 3
    assert not any("shared_experts" in n or "layers.0." in n for n in read)
    assert PREFIX + "gate.e_score_correction_bias" in read


@pytest.mark.parametrize("rows", [[], [2], [0, 1, 2], [0, 2, 3, 5]])
def test_rows_of_a_tensor_read_in_runs(tmp_path, rows):
    whole = torch.randn(6, 4)
    safetensors_torch.save_file({"experts.gate_up_proj": whole},
                                str(tmp_path / "model.safetensors"))  # fmt: skip
    got = CheckpointFiles(tmp_path).read(["experts.gate_up_proj"], rows, 6)
    assert torch.equal(got["experts.gate_up_proj"], whole[rows])


def test_prefixes_and_errors(tmp_path):
    names = ["model.layers.0.mlp.gate_proj.weight", "model.layers.3.mlp.experts.0.w.weight",
             "model.layers.3.mlp.shared_experts.gate_proj.weight",
             "language_model.model.layers.4.block_sparse_moe.experts.7.w1.weight",
             "model.layers.5.mlp.experts.gate_up_proj_blocks"]  # fmt: skip
    assert layer_prefix(names, 3) == "model.layers.3.mlp."
    assert layer_prefix(names, 4) == "language_model.model.layers.4.block_sparse_moe."
    assert layer_prefix(names, 5) == "model.layers.5.mlp."
    with pytest.raises(ValueError, match="layer 0 has no expert tensors in the checkpoint; "
                                         "layers with experts: 3, 3 to 5"):  # fmt: skip
        layer_prefix(names, 0)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor"):
        CheckpointFiles(tmp_path)
    _write(tmp_path, _checkpoint(), 2)
    assert moe_layers(tmp_path) == moe_layers(tmp_path / "config.json") == [1]  # layer 0 dense
    files = CheckpointFiles(tmp_path)
    (tmp_path / files.file_of[PREFIX + "gate.weight"]).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        layer_tensors(files, PREFIX, range(E), E)
    with pytest.raises(ValueError, match="layer 0 has no expert tensors"):
        MoE.from_pretrained(tmp_path, 0)


def test_checkpoint_files_shared_until_the_index_changes(tmp_path):
    """Building every layer of a model parses its index once: `CheckpointFiles.of` hands back
    the files it opened while the index is the same file, and opens them again once it is not.
    `names_under` and a checkpoint's `layer_prefix` agree with scanning the names."""
    index = tmp_path / "model.safetensors.index.json"
    weight_map = {f"model.layers.{i}.mlp.experts.0.w1.weight": "a.safetensors"
                  for i in (1, 10, 11)}  # fmt: skip
    index.write_text(json.dumps({"weight_map": weight_map}))
    files = CheckpointFiles.of(tmp_path)
    assert CheckpointFiles.of(tmp_path / ".") is files
    assert files.names_under("model.layers.1.") == ("model.layers.1.mlp.experts.0.w1.weight",)
    assert files.names_under("model.layers.1") == files.names
    assert files.names_under("model.layers.2") == ()
    for layer in (1, 10, 11):
        assert layer_prefix(files, layer) == layer_prefix(list(files.names), layer)
    weight_map["model.layers.12.mlp.experts.0.w1.weight"] = "a.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))  # longer: another size
    assert CheckpointFiles.of(tmp_path) is not files
    assert moe_layers(tmp_path) == [1, 10, 11, 12]


def test_from_pretrained_draws_no_random_experts(tmp_path, monkeypatch):
    """The layer is made without experts (no random draw, no memory for them) and the load fills
    them: monkeypatched, drawing would fail."""
    _write(tmp_path, _checkpoint(), 1)
    monkeypatch.setattr(MoE, "reset_parameters", lambda self: pytest.fail("drew random experts"))
    layer = MoE.from_pretrained(tmp_path, 1, dtype="float32")
    assert not layer.w13.is_meta and layer.quant_spec.name == "int4_w4a16"


def test_from_pretrained_dequantizes_when_asked_for_unquantized_experts(tmp_path):
    """weight_format='unquantized' of an int4 checkpoint: the experts as the int4 layer's
    dequantized twin, held as parameters in the layer's dtype, the scales gone."""
    _write(tmp_path, _checkpoint(), 1)
    run = RunnerConfig(moe_runner_backend="torch")
    int4 = MoE.from_pretrained(tmp_path, 1, runner=run, dtype="float32")
    plain = MoE.from_pretrained(tmp_path, 1, runner=run, dtype="float32",
                                weight_format="unquantized")  # fmt: skip
    assert plain.quant_spec is None and plain.config.weight_format == "unquantized"
    assert isinstance(plain.w13, torch.nn.Parameter) and plain.w13.dtype == torch.float32
    assert not any(n.endswith("_scale") for n, _ in plain.named_buffers())
    want = int4.expert_weights.dequantized(torch.float32)
    assert torch.equal(plain.w13, want.w13) and torch.equal(plain.w2, want.w2)
    x, logits = torch.randn(6, H), torch.randn(6, E)
    torch.testing.assert_close(plain(x, logits), int4(x, logits), rtol=1e-5, atol=1e-6)
    int4.dequantize_weights_()  # in place, the same
    assert torch.equal(int4.w13, plain.w13) and int4.quant_spec is None


@pytest.mark.parametrize("weight_format", [None, "int8_w8a16"])
def test_a_layer_made_without_experts_refuses_to_run_until_loaded(weight_format):
    """init_weights=False: meta experts, a clear error before a load, then the same layer as one
    drawn at random and loaded (unquantized, or quantized to the layer's format on the load)."""
    from moekit import MoEConfig

    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                       dtype="float32")  # fmt: skip
    empty = MoE(config, weight_format=weight_format, init_weights=False)
    assert empty.w13.is_meta and empty.w2.is_meta
    x, logits = torch.randn(3, H), torch.randn(3, E)
    with pytest.raises(RuntimeError, match="experts are not loaded: .*init_weights=False"):
        empty(x, logits)
    sd = {f"experts.{e}.{n}.weight": torch.randn(shape) / 16 for e in range(E)
          for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
    drawn = MoE(config, weight_format=weight_format)
    for layer in (empty, drawn):
        layer.load_hf_state_dict(sd)
    assert not empty.w13.is_meta and empty.quant_spec == drawn.quant_spec
    assert torch.equal(empty(x, logits), drawn(x, logits))


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_an_ep_rank_reads_only_the_experts_of_its_slots(tmp_path, monkeypatch, family):
    """Of fused expert tensors ([E, ...], gpt-oss) an EP rank reads only its experts' rows, as
    of per-expert ones (Mixtral) only its experts; its layer holds the whole layer's experts of
    its slots, under an EPLB placement too (redundant slots, out of order)."""
    from moekit.placement import ExpertPlacement

    AutoModelForCausalLM = pytest.importorskip("transformers").AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_tiny_config(family)).save_pretrained(tmp_path)
    run = RunnerConfig(moe_runner_backend="torch")
    whole = MoE.from_pretrained(tmp_path, 1, runner=run, dtype="float32")
    shapes = _record_reads(monkeypatch)
    balanced = ExpertPlacement(torch.tensor([5, 1, 0, 6, 5, 2, 7, 3, 4, 1]), ep_size=2)
    layouts = [  # (parallel, placement, experts of rank 0's and rank 1's slots): 8 experts
        (ParallelConfig(tp_size=2, ep_size=2), None, ([0, 1, 2, 3], [4, 5, 6, 7])),
        (ParallelConfig(tp_size=2, ep_size=2, ep_num_redundant_experts=2), balanced,
         ([5, 1, 0, 6, 5], [2, 7, 3, 4, 1])),
    ]  # fmt: skip
    for parallel, placement, slots in layouts:
        for rank, held in enumerate(slots):
            shapes.clear()
            layer = MoE.from_pretrained(tmp_path, 1, parallel, run, tp_rank=rank,
                                        placement=placement, dtype="float32")  # fmt: skip
            assert layer.local_experts.tolist() == held
            experts = {n.split(".experts.")[1]: shape for n, shape in shapes.items()
                       if ".experts." in n}  # fmt: skip
            if family == "gpt_oss":  # fused: a row of each tensor for each distinct expert
                assert sorted(experts) == ["down_proj", "down_proj_bias", "gate_up_proj",
                                           "gate_up_proj_bias"]  # fmt: skip
                assert {shape[0] for shape in experts.values()} == {len(set(held))}, experts
            else:
                assert {int(n.split(".")[0]) for n in experts} == set(held)
            for name in ("w13", "w2", "b13", "b2"):
                got, want = getattr(layer, name), getattr(whole, name)
                if want is not None:
                    assert torch.equal(got, want[held]), name


def test_an_ep_rank_reads_its_rows_of_gpt_oss_mxfp4_blocks(tmp_path, monkeypatch):
    """gpt-oss's mxfp4 experts (gate_up_proj_blocks / _scales, fused [E, ...]): an EP2 rank
    reads 4 rows of 8 of each and holds the whole layer's quantized experts of its slots."""
    from moekit.quant import quantize

    config = _tiny_config("gpt_oss").to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    n, h, i, mlp = 8, 64, 32, "model.layers.1.mlp."
    q13 = quantize(torch.randn(n, 2 * i, h) / 16, "mxfp4")
    q2 = quantize(torch.randn(n, h, i) / 16, "mxfp4")
    sd = {mlp + "experts.gate_up_proj_blocks": q13.data.reshape(n, 2 * i, h // 32, 16),
          mlp + "experts.gate_up_proj_scales": q13.scale,
          mlp + "experts.gate_up_proj_bias": torch.randn(n, 2 * i),
          mlp + "experts.down_proj_blocks": q2.data.reshape(n, h, i // 32, 16),
          mlp + "experts.down_proj_scales": q2.scale,
          mlp + "experts.down_proj_bias": torch.randn(n, h),
          mlp + "router.weight": torch.randn(n, h),
          mlp + "router.bias": torch.randn(n)}  # fmt: skip
    safetensors_torch.save_file(sd, str(tmp_path / "model.safetensors"))
    whole = MoE.from_pretrained(tmp_path, 1, dtype="float32")
    assert whole.quant_spec.name == "mxfp4"
    shapes = _record_reads(monkeypatch)
    for rank in range(2):
        layer = MoE.from_pretrained(tmp_path, 1, ParallelConfig(tp_size=2, ep_size=2),
                                    tp_rank=rank, dtype="float32")  # fmt: skip
        assert {shape[0] for name, shape in shapes.items() if ".experts." in name} == {4}
        held = layer.local_experts.tolist()
        for name in ("w13", "w2", "w13_scale", "w2_scale", "b13", "b2"):
            assert torch.equal(getattr(layer, name), getattr(whole, name)[held]), name


def run_two_ranks_case(directory: str) -> None:
    """On each of 2 gloo ranks: the layer of a parallel state (alltoall EP2) read from
    `directory`, against the whole layer on this rank's tokens."""
    from moekit.parallel import init_parallel

    state = init_parallel(ParallelConfig(tp_size=2, ep_size=2, moe_a2a_backend="alltoall"))
    run = RunnerConfig(moe_runner_backend="torch")
    layer = MoE.from_pretrained(directory, 1, runner=run, state=state, dtype="float32")
    whole = MoE.from_pretrained(directory, 1, runner=run, dtype="float32")
    assert layer.local_experts.tolist() == [[0, 1], [2, 3]][state.rank]
    g, T = torch.Generator().manual_seed(state.rank), 5 + 3 * state.rank
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    torch.testing.assert_close(layer(x, logits), whole(x, logits), rtol=1e-5, atol=1e-6)


def test_from_pretrained_with_a_parallel_state_on_two_ranks(tmp_path):
    from tests.dist_utils import get_pool

    _write(tmp_path, _checkpoint(), 2)
    get_pool(2).run(run_two_ranks_case, str(tmp_path))


@pytest.mark.gpu
def test_from_pretrained_on_the_gpu_gpu(tmp_path):
    """The layer read onto the GPU runs its int4 experts in `auto` as in the `torch` reference."""
    _write(tmp_path, _checkpoint(), 2)
    x, logits = torch.randn(9, H, device="cuda").bfloat16(), torch.randn(9, E, device="cuda")
    outs = [MoE.from_pretrained(tmp_path, 1, runner=RunnerConfig(moe_runner_backend=b),
                                device="cuda")(x, logits).float()
            for b in ("auto", "torch")]  # fmt: skip
    assert ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_an_ep_rank_of_a_bf16_checkpoint_on_the_gpu_gpu(tmp_path, family):
    """An EP2 rank's bf16 experts (gpt-oss's fused rows, Mixtral's per-expert tensors) made on
    the GPU by the load: `auto` against `torch` on the rank's own routing."""
    AutoModelForCausalLM = pytest.importorskip("transformers").AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_tiny_config(family)).save_pretrained(tmp_path)
    x, logits = torch.randn(9, 64, device="cuda").bfloat16(), torch.randn(9, 8, device="cuda")
    outs = []
    for backend in ("auto", "torch"):
        layer = MoE.from_pretrained(tmp_path, 1, ParallelConfig(tp_size=2, ep_size=2),
                                    RunnerConfig(moe_runner_backend=backend), tp_rank=1,
                                    device="cuda", dtype="bfloat16")  # fmt: skip
        assert layer.w13.device.type == "cuda" and layer.w13.dtype == torch.bfloat16
        outs.append(layer(x, logits).float())
    assert ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < 2e-2


def _tiny_config(family: str):
    """A tiny transformers model config of a MoE family, MoE block in layer 1: softmax top-k
    (Qwen3-MoE, Qwen2-MoE with a gated shared expert, OLMoE), Mixtral's, DeepSeek-V3's and
    GLM-4.5's sigmoid with groups and a correction bias (DeepSeek-V3's config, as transformers
    writes it, names neither scoring_func nor topk_method), gpt-oss's fused experts with biases
    and a router bias."""
    t = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2)
    grouped = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_group=2,
                   topk_group=1, n_shared_experts=1, first_k_dense_replace=1)
    make = {
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**common, intermediate_size=96, head_dim=16,
                                              moe_intermediate_size=32, num_experts=8,
                                              norm_topk_prob=True, mlp_only_layers=[0]),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**common, intermediate_size=96,
                                              moe_intermediate_size=32, num_experts=8,
                                              shared_expert_intermediate_size=32),
        "olmoe": lambda: t.OlmoeConfig(**common, intermediate_size=32, num_experts=8),
        "mixtral": lambda: t.MixtralConfig(**common, intermediate_size=32, num_local_experts=8),
        "deepseek_v3": lambda: t.DeepseekV3Config(**{**common, "num_key_value_heads": 4},
                                                  **grouped, q_lora_rank=16, kv_lora_rank=16,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                  v_head_dim=16, routed_scaling_factor=2.5),
        "glm4_moe": lambda: t.Glm4MoeConfig(**common, **grouped, head_dim=16),
        "gpt_oss": lambda: t.GptOssConfig(**common, intermediate_size=32, num_local_experts=8,
                                          head_dim=16, layer_types=["full_attention"] * 2),
    }
    return make[family]()  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3",
                                    "glm4_moe", "gpt_oss"])  # fmt: skip
def test_a_transformers_checkpoint_runs_like_its_own_block(tmp_path, family):
    """save_pretrained of a tiny transformers model, then layer 1 through MoE.from_pretrained
    against the model's own MoE block (its routed experts: a shared expert's output taken
    away) on the logits of its own router."""
    config = _tiny_config(family)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    block = model.model.layers[1].mlp
    router = getattr(block, "gate", None) or block.router
    if hasattr(router, "e_score_correction_bias"):
        router.e_score_correction_bias.normal_()  # the grouped choice must follow it
    model.save_pretrained(tmp_path)
    dense_first = family in ("qwen3_moe", "deepseek_v3", "glm4_moe")  # layer 0 a dense MLP
    assert moe_layers(tmp_path) == ([1] if dense_first else [0, 1])
    layer = MoE.from_pretrained(tmp_path, 1, runner=RunnerConfig(moe_runner_backend="torch"),
                                dtype="float32")  # fmt: skip
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
        if shared is not None:
            gate = getattr(block, "shared_expert_gate", None)
            want = want - shared(x) * (1 if gate is None else torch.sigmoid(gate(x)))
        logits = torch.nn.functional.linear(x[0], router.weight, getattr(router, "bias", None))
        got = layer(x[0], logits)
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-6)
