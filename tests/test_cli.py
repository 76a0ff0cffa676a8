"""`moekit env`, `moekit bench` and `moekit tune` through the CLI entry point."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moekit import report
from moekit.cli import bench as bench_cli
from moekit.cli.main import main
from moekit.config import A2A_BACKENDS, RUNNER_BACKENDS
from moekit.placement import load_placements
from moekit.presets import PRESETS

# A generous time budget: a loaded CI machine must not turn points into "skipped".
TINY = ["--device", "cpu", "--batch-sizes", "1,8", "--no-plot", "--time-budget", "600"]


def test_env_tables(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for text in ("MOEKIT_LOG_LEVEL", "torch", "available", "unavailable", "deepep", "triton"):
        assert text in out


def test_env_json(capsys, monkeypatch):
    monkeypatch.setenv("MOEKIT_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("MOEKIT_NOT_A_THING", "1")
    assert main(["env", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in doc["runners"]} == set(RUNNER_BACKENDS) - {"auto"}
    assert {a["name"] for a in doc["a2a"]} == set(A2A_BACKENDS)
    torch_runner = next(r for r in doc["runners"] if r["name"] == "torch")
    assert torch_runner["available"] and torch_runner["caps"]["cuda_graph"] is False
    for r in doc["runners"] + doc["a2a"]:
        assert r["available"] or r["reason"], r  # every unavailable one says why
    log = next(v for v in doc["env"] if v["name"] == "MOEKIT_LOG_LEVEL")
    assert log["value"] == "WARNING" and log["set"]
    assert doc["unknown_env"] == ["MOEKIT_NOT_A_THING"]
    assert "torch" in doc["libraries"] and doc["device"]["type"] in ("cpu", "cuda")


def test_env_explain(capsys):
    args = ["env", "--explain", "--model", "gpt-oss-120b", "--batch-size", "4",
            "--tp-size", "2", "--ep-size", "2", "--json"]
    assert main(args) == 0
    ex = json.loads(capsys.readouterr().out)["explain"]
    assert ex["workload"]["activation"] == "swiglu_oai" and ex["workload"]["has_bias"]
    assert ex["workload"]["experts_local"] == 64 and ex["workload"]["num_tokens"] == 4
    chosen = [b["name"] for b in ex["backends"] if b["status"] == "chosen"]
    assert chosen == [ex["decision"]["backend"]]
    on_gpu = torch.cuda.is_available()
    assert ex["routing"].startswith("one Triton kernel" if on_gpu else "PyTorch ops")
    assert main(["env", "--explain", "--model", "mixtral-8x7b"]) == 0
    out = capsys.readouterr().out
    assert "picked:" in out and "each runner for this workload" in out and "routing: " in out


def test_env_explain_bad_preset(capsys):
    assert main(["env", "--explain", "--model", "gpt-5"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and all(name in err for name in PRESETS)


def test_bench_tiny(tmp_path, capsys):
    out_dir = tmp_path / "res"
    rc = main(["bench", "--device", "cpu", "--batch-sizes", "0,1,8", "--backends", "torch,auto",
               "--time-budget", "600", "--out-dir", str(out_dir)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "SCALED-DOWN" in out and "routing precomputed, not timed" in out
    assert "backend torch" in out and "winner per T" in out and "time/floor" in out
    (json_path,) = out_dir.glob("*.json")
    (png_path,) = out_dir.glob("*.png")
    assert png_path.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(json_path.read_text())
    for key in ("device", "libraries", "commit", "command", "ceilings", "records", "timed",
                "shape", "parallel", "dtype", "quantization", "routing", "batch_sizes"):
        assert key in doc, key
    assert doc["scaled_down"] and doc["preset"] == "qwen3-30b-a3b"
    assert doc["command"].startswith("moekit")
    assert doc["ceilings"]["copy_bytes_per_s"] > 0 and doc["ceilings"]["matmul_flops_per_s"] > 0
    assert {(r["backend"], r["T"]) for r in doc["records"]} == {
        (b, t) for b in ("torch", "auto") for t in (0, 1, 8)
    }
    assert all(r["ms"] > 0 for r in doc["records"])
    assert not (out_dir.parent / "BENCHMARKS.md").exists()  # only for the repo's results dir


def test_bench_and_explain_a_hugging_face_config(tmp_path, capsys):
    """--model as a config.json directory: the sweep runs the model's MoE block, the result
    file is named after the directory, and `env --explain` takes it too."""
    model = tmp_path / "Mixtral-8x7B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_local_experts": 8, "num_experts_per_tok": 2}))
    out_dir = tmp_path / "res"
    assert main(["bench", *TINY, "--backends", "torch", "--model", str(model),
                 "--out-dir", str(out_dir)]) == 0
    (path,) = out_dir.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["preset"] == str(model) and "_mixtral-8x7b-instruct-cpusmall_tp1ep1_" in path.name
    assert report.title(doc).startswith("Mixtral-8x7B-Instruct (CPU scale-down) · tp1 ep1")
    assert (doc["shape"]["num_experts"], doc["shape"]["top_k"]) == (8, 2)
    assert main(["env", "--explain", "--model", str(model / "config.json")]) == 0
    assert main(["bench", *TINY, "--model", str(tmp_path / "nope"), "--out-dir",
                 str(out_dir)]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_bench_alias_zipf_and_ep(tmp_path, capsys):
    rc = main(["bench", *TINY, "--moe-runner-backend", "torch", "--model", "deepseek-v3",
               "--tp-size", "4", "--ep-size", "2", "--routing", "zipf", "--zipf-s", "1.5",
               "--out-dir", str(tmp_path)])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["parallel"] == {"tp_size": 4, "ep_size": 2, "moe_tp_size": 2, "rank": 0}
    assert doc["shape"]["experts_local"] * 2 == doc["shape"]["num_experts"]
    assert doc["routing"]["kind"] == "zipf" and doc["routing"]["zipf_s"] == 1.5
    assert "zipf1.5" in next(tmp_path.glob("*.json")).name


def test_bench_updates_benchmarks_md_in_repo_results(tmp_path, monkeypatch, capsys):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    monkeypatch.setattr(bench_cli, "repo_root", lambda: tmp_path)
    assert main(["bench", *TINY, "--backends", "torch"]) == 0
    assert len(list((tmp_path / "benchmarks" / "results").glob("*.json"))) == 1
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "qwen3-30b-a3b (CPU scale-down)" in md and "| 8 |" in md


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "llama-moe"], "--model: 'llama-moe' is neither a preset (qwen3-30b-a3b"),
        (["--backends", "torch,fastest"], "--backends: unknown value 'fastest'; allowed: all"),
        (["--moe-runner-backend", "fastest"], "--moe-runner-backend: unknown value 'fastest'"),
        (["--backends", "torch", "--moe-runner-backend", "torch"], "not both"),
        (["--batch-sizes", "1,two"], "--batch-sizes"),
        (["--routing", "pareto"], "--routing: unknown value 'pareto'"),
        (["--tp-size", "3", "--ep-size", "2"], "--ep-size (2) must divide --tp-size (3)"),
        (["--dtype", "int3"], "--dtype: unknown value 'int3'"),
        (["--backends", "flashinfer_trtllm"], "none of the requested backends"),
    ],
)
def test_bench_errors(args, needle, tmp_path, capsys):
    assert main(["bench", *TINY, "--out-dir", str(tmp_path), *args]) == 2
    assert needle in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.skipif(
    importlib.util.find_spec("moekit.cli.tune") is not None, reason="this build has moekit tune"
)
def test_tune_unavailable(capsys):
    assert main(["tune", "--model", "qwen3-30b-a3b"]) == 2
    assert "not available in this build" in capsys.readouterr().err


def test_no_command_and_module_entry():
    assert main([]) == 2
    src = str(Path(__file__).resolve().parents[1] / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "moekit.cli.main", "--version"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": src},
    )
    assert proc.returncode == 0 and proc.stdout.startswith("moekit ")


@pytest.mark.gpu
def test_bench_gpu_every_available_backend(tmp_path, capsys):
    """On the GPU: the real qwen3-30b-a3b shape, two batch sizes, every available backend;
    every point must run (CUDA graph capture included) and match the torch reference."""
    assert main(["bench", "--batch-sizes", "1,256", "--no-plot", "--out-dir", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["device"]["type"] == "cuda" and not doc["scaled_down"]
    assert doc["records"]
    for r in doc["records"]:
        assert r["error"] is None, r
        assert not r["suspicious"], r
        if r["backend"] == "torch":
            assert r["cuda_graph"] is False  # the reference runner syncs with the host


def test_eplb_simulated_and_measured_load(tmp_path, capsys):
    out = tmp_path / "placement.json"
    assert main(["eplb", "--model", "deepseek-v3", "--ep-size", "8",
                 "--ep-num-redundant-experts", "32", "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "256 experts, 1 layer(s); 288 slots over 8 ranks (36 each)" in text
    before, after = (float(v) for v in text.split("balancedness (mean / max rank load) ")[1]
                     .split(";")[0].split(" -> "))  # fmt: skip
    assert before < 0.6 and after > 0.95  # zipf 1.2 over 256 experts, then balanced
    saved = json.loads(out.read_text())
    assert saved["ep_size"] == 8 and sorted(set(saved["placements"][0])) == list(range(256))
    (placement,) = load_placements(out)
    assert placement.ep_size == 8 and placement.physical_to_logical.tolist() == saved["placements"][0]
    # a measured load per layer (JSON), and a recorder's counts saved with torch.save
    load = tmp_path / "load.json"
    load.write_text(json.dumps([[50, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]))
    assert main(["eplb", "--load", str(load), "--ep-size", "2",
                 "--ep-num-redundant-experts", "2"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "6 experts, 2 layer(s); 8 slots over 2 ranks" in text and "layer 1:" in text
    counts = tmp_path / "counts.pt"
    torch.save(torch.tensor([9, 0, 3, 4], dtype=torch.int64), counts)
    assert main(["eplb", "--load", str(counts), "--ep-size", "2"]) == 0


@pytest.mark.parametrize("args,needle", [
    (["--ep-size", "3"], "--ep-size (3) must divide the 128 experts + 0 redundant = 128 slots"),
    (["--ep-size", "2", "--load", "/nope.json"], "--load: no such file '/nope.json'"),
    (["--ep-size", "2", "--ep-num-redundant-experts", "-2"], "must be an integer >= 0, got -2"),
    (["--ep-size", "0"], "--ep-size must be a positive integer, got 0"),
])  # fmt: skip
def test_eplb_errors(args, needle, capsys):
    assert main(["eplb", *args]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("name, text, needle", [
    ("load.json", '{"a": 1}', "is not a JSON list (of lists) of numbers"),
    ("load.json", "[1, 2,", "is not a JSON list"),
    ("load.pt", "[1, 2]", "is not a JSON list"),  # text where a torch.save'd tensor belongs
    ("load.JSON", "[[1, -2, 3, 4]]", "loads must be finite counts >= 0"),
    ("load.json", "[1, NaN, 3, 4]", "loads must be finite counts >= 0"),
])  # fmt: skip
def test_eplb_load_files_that_hold_no_load_are_refused(tmp_path, capsys, name, text, needle):
    (tmp_path / name).write_text(text)
    assert main(["eplb", "--load", str(tmp_path / name), "--ep-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--load:" in err and needle in err and "Traceback" not in err


def test_bench_and_explain_a_format_with_parameters(tmp_path, capsys):
    """--quantization NAME:key=value,...: the layer runs that spec (static fp8 scales
    calibrated for the bench's N(0, 1) inputs), the result names it; bad ones exit 2."""
    fmt = "fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor"
    out_dir = tmp_path / "res"
    assert main(["bench", *TINY, "--backends", "torch", "--quantization", fmt,
                 "--out-dir", str(out_dir)]) == 0  # fmt: skip
    assert f"{fmt} weights" in capsys.readouterr().out
    (path,) = out_dir.glob("*.json")
    assert json.loads(path.read_text())["quantization"] == fmt
    assert main(["env", "--explain", "--quantization", fmt]) == 0
    assert "activation_scheme=static_tensor" in capsys.readouterr().out
    assert main(["bench", *TINY, "--quantization", "fp8_w8a8:weight_scale=row",
                 "--out-dir", str(out_dir)]) == 2  # fmt: skip
    assert "weight_scale must be one of 'tensor', 'channel', 'block'" in capsys.readouterr().err
