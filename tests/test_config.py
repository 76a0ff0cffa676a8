"""Every validation rule gives a ConfigError naming the option and what is allowed."""

import pytest
import torch

from moekit.config import (
    ConfigError,
    MoEConfig,
    ParallelConfig,
    RunnerConfig,
    per_rank,
    validate,
)

BASE = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)


def moe(**kw):
    return MoEConfig(**{**BASE, **kw})


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_experts=0), ["--num-experts", "positive"]),
        (dict(top_k=9), ["--top-k", "--num-experts"]),
        (dict(activation="relu"), ["--activation", "relu", "gelu, silu, swiglu_oai"]),
        (dict(scoring_func="tanh"), ["--scoring-func", "sigmoid, softmax"]),
        (dict(dtype="float8"), ["--dtype", "bfloat16"]),
        (dict(dtype=torch.float8_e4m3fn), ["--dtype", "torch.float8_e4m3fn", "float32"]),
        (dict(weight_format="fp3"), ["--quantization", "mxfp4"]),
        (dict(num_expert_group=4), ["--num-expert-group", "--topk-group"]),
        (dict(num_expert_group=3, topk_group=1), ["--num-expert-group (3)", "divide"]),
        (dict(num_expert_group=4, topk_group=5), ["--topk-group (5)", "at most"]),
        (dict(num_expert_group=4, topk_group=1, top_k=3), ["--top-k (3)", "groups of 2"]),
        (dict(swiglu_limit=0.0), ["--swiglu-limit"]),
        (dict(num_shared_experts=-1), ["--num-shared-experts"]),
    ],
)
def test_moe_config_errors(kwargs, words):
    with pytest.raises(ConfigError) as err:
        moe(**kwargs)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtype_given_as_torch_dtype(dtype):
    """A torch dtype names the same config as its name (equal, hashed alike, same torch_dtype)."""
    config = moe(dtype=getattr(torch, dtype))
    assert config == moe(dtype=dtype) and hash(config) == hash(moe(dtype=dtype))
    assert config.dtype == dtype and config.torch_dtype is getattr(torch, dtype)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tp_size=4, ep_size=3), ["--ep-size (3)", "--tp-size (4)", "moe_tp_size"]),
        (dict(tp_size=0), ["--tp-size", "positive"]),
        (dict(moe_a2a_backend="nccl"), ["--moe-a2a-backend", "alltoall", "deepep", "none"]),
        (dict(deepep_mode="fast"), ["--deepep-mode", "low_latency", "normal"]),
        (dict(moe_dense_tp_size=2), ["--moe-dense-tp-size"]),
        (dict(ep_num_redundant_experts=-1), ["--ep-num-redundant-experts"]),
    ],
)
def test_parallel_config_errors(kwargs, words):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_runner_config_errors():
    with pytest.raises(ConfigError, match="--moe-runner-backend.*cutlass.*flashinfer_trtllm"):
        RunnerConfig(moe_runner_backend="vllm")
    with pytest.raises(ConfigError, match="--enable-adaptive-moe.*torch"):
        RunnerConfig(moe_runner_backend="torch", enable_adaptive_moe=True)
    with pytest.raises(ConfigError, match="--adaptive-moe-batch-threshold"):
        RunnerConfig(adaptive_moe_batch_threshold=0)


def test_a2a_backend_forces_ep_equal_tp(caplog):
    p = ParallelConfig(tp_size=4, ep_size=1, moe_a2a_backend="alltoall")
    assert p.ep_size == 4 and p.moe_tp_size == 1


def test_moe_tp_size_and_per_rank_shape():
    p = ParallelConfig(tp_size=8, ep_size=2)
    assert p.moe_tp_size == 4
    assert per_rank(moe(intermediate_size=64), p).intermediate_size == 16


@pytest.mark.parametrize(
    "m, p, r, words",
    [
        (moe(intermediate_size=30), ParallelConfig(tp_size=4), RunnerConfig(),
         ["--intermediate-size (30)", "moe_tp_size", "4"]),
        (moe(num_experts=6), ParallelConfig(tp_size=4, ep_size=4), RunnerConfig(),
         ["divisible by --ep-size (4)"]),
        (moe(weight_format="int4_w4a16"), ParallelConfig(tp_size=2),
         RunnerConfig(moe_runner_backend="flashinfer_cutlass"), ["flashinfer_cutlass", "nvfp4"]),
        (moe(weight_format="nvfp4"), ParallelConfig(tp_size=4, ep_size=2),
         RunnerConfig(moe_runner_backend="flashinfer_cutlass"), ["--ep-size 1", "(4)"]),
        (moe(weight_format="fp8_w8a8"), ParallelConfig(tp_size=2, ep_size=2),
         RunnerConfig(moe_runner_backend="cutlass"), ["cutlass", "fp8", "--ep-size 1"]),
        (moe(num_shared_experts=1, num_experts=7), ParallelConfig(tp_size=2, ep_size=2),
         RunnerConfig(), ["--num-shared-experts", "--ep-size 1"]),
    ],
)
def test_cross_validation(m, p, r, words):
    with pytest.raises(ConfigError) as err:
        validate(m, p, r)
    for w in words:
        assert w in str(err.value)


def test_valid_combinations_pass():
    validate(moe(weight_format="nvfp4"), ParallelConfig(tp_size=4, ep_size=4),
             RunnerConfig(moe_runner_backend="flashinfer_cutlass"))
    validate(moe(weight_format="fp8_w8a8"), ParallelConfig(tp_size=2),
             RunnerConfig(moe_runner_backend="cutlass"))
    validate(moe(num_shared_experts=1, num_experts=7), ParallelConfig(), RunnerConfig())


def test_flags_must_be_booleans():
    """A string flag would read as true ('no' included): refused by name."""
    with pytest.raises(ConfigError, match="--enable-eplb must be True or False, got 'no'"):
        ParallelConfig(enable_eplb="no")
    with pytest.raises(ConfigError, match="--enable-adaptive-moe must be True or False, got 'yes'"):
        RunnerConfig(enable_adaptive_moe="yes")
    with pytest.raises(ConfigError, match="--has-bias must be True or False, got 1"):
        MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, has_bias=1)
    assert ParallelConfig(enable_eplb=True).enable_eplb
