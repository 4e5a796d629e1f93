"""The benchmark races the same model: the PyTorch twin computes our model's loss on our weights."""

import dataclasses

import jax
import numpy as np
import pytest

from lib.config import ModelConfig
from lib.loss import valid_token_mean
from lib.model import Llama

torch = pytest.importorskip("torch")

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=40)


def copy_into_torch(model: Llama, twin) -> None:
    t = lambda x: torch.from_numpy(np.asarray(x).copy())
    with torch.no_grad():
        twin.embed.weight.copy_(t(model.embed))
        twin.lm_head.weight.copy_(t(model.lm_head).T)
        twin.final_norm.weight.copy_(t(model.final_norm.weight))
        for i, block in enumerate(twin.blocks):
            b = jax.tree.map(lambda x: x[i], model.blocks)
            block.attn_norm.weight.copy_(t(b.attn_norm.weight))
            block.mlp_norm.weight.copy_(t(b.mlp_norm.weight))
            for name, w in (("wq", b.attn.wq), ("wk", b.attn.wk), ("wv", b.attn.wv), ("wo", b.attn.wo),
                            ("w_gate", b.mlp.w_gate), ("w_up", b.mlp.w_up), ("w_down", b.mlp.w_down)):
                getattr(block, name).weight.copy_(t(w).T)  # torch Linear stores [out, in]


def test_torch_twin_matches_the_jax_model():
    from recipes.torch_llama import TorchLlama

    model = Llama(CFG, jax.random.PRNGKey(0))
    twin = TorchLlama(CFG)
    copy_into_torch(model, twin)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 10)).astype(np.int32)
    ours = np.asarray(model(tokens))
    theirs = twin(torch.from_numpy(tokens).long()).detach().numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-5)
    loss = float(valid_token_mean(ours, tokens, np.ones_like(tokens, bool)))
    assert np.isfinite(loss)


def test_gpu_mfu_script_runs_its_real_step_on_a_toy_shape(capsys):
    from recipes import bench_gpu

    result = bench_gpu.main(["--tiny", "--repeats", "2", "--warmup", "1", "--peak-flops", "1e12"])
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1
    assert result["remat"] == "selective" and result["attention_impl"] == "blocked"  # cuDNN only on a GPU
    assert "MFU" in capsys.readouterr().out


def test_gpu_script_reports_a_failing_attention_and_still_measures_the_others(capsys):
    from recipes import bench_gpu

    if jax.default_backend() == "gpu":
        pytest.skip("cuDNN attention would run here")
    argv = ["--tiny", "--repeats", "1", "--warmup", "0", "--peak-flops", "1e12"]
    result = bench_gpu.main([*argv, "--attention", "cudnn,xla"])
    failed, measured = result["runs"]
    assert "needs an NVIDIA GPU" in failed["error"] and measured["attention_impl"] == "xla" == result["attention_impl"]
    assert "attention=cudnn    failed: ConfigError: model.attention_impl=cudnn needs an NVIDIA GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no attention implementation could be measured"):
        bench_gpu.main([*argv, "--attention", "cudnn"])
    with pytest.raises(SystemExit, match="give a comma-separated list of blocked, cudnn, xla"):
        bench_gpu.main([*argv, "--attention", "flash"])


def test_compiled_memory_table_reports_remat_savings():
    from recipes.bench import compiled_memory

    none = compiled_memory(CFG, 32, 8)
    layer = compiled_memory(dataclasses.replace(CFG, remat="layer"), 32, 8)
    assert 0 < layer["temp_bytes"] < 0.8 * none["temp_bytes"]
    # scan_unroll must not undo it: unrolled blocks would let XLA merge the recomputation into the forward.
    unrolled = compiled_memory(dataclasses.replace(CFG, remat="layer", scan_unroll=CFG.n_layers), 32, 8)
    assert unrolled["temp_bytes"] == layer["temp_bytes"]


def test_race_takes_turns_and_reports_each_median():
    from recipes.bench import race

    calls = []
    medians = race({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, repeats=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-up each, then alternating
    assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())


def test_race_shows_its_turns_and_running_medians_on_stderr(capsys):
    import re
    import time

    from recipes.bench import race

    race({"a": lambda: time.sleep(0.06), "b": lambda: time.sleep(0.06)}, warmup=1, repeats=3, label="issue")
    out, err = capsys.readouterr()
    assert out == "" and "issue" in err and "3/4" in err and re.search(r"a 6\d ms, b 6\d ms", err)


def test_checkpoint_stall_is_measured_like_the_training_loop():
    from recipes.bench import bench_checkpoint_stall

    stall = bench_checkpoint_stall(CFG, 16, 2, saves=2, every=2)
    assert 0 < stall["save_call_s"] and 0 < stall["step_s"]
    assert "next_step_extra_s" in stall


def test_matmul_floor_counts_every_matmul_of_the_step():
    """Forward, backward and the fused head: the floor's FLOPs are the model's FLOPs up to causal skipping."""
    from lib.metrics import flops_per_token
    from recipes.bench import matmul_runner, race

    seq, batch = 16, 2
    floor = matmul_runner(CFG, seq, batch)
    model_flops = flops_per_token(CFG, seq) * seq * batch
    assert 0 < race({"matmuls": floor["step"]}, warmup=1, repeats=1)["matmuls"]
    # Attention is counted dense in model FLOPs but computed dense here too (attention_block 128 > seq).
    assert floor["matmul_flops"] == pytest.approx(model_flops, rel=1e-6)


def test_variants_are_model_settings_and_a_typo_is_named():
    from recipes.bench import parse_variant

    cfg = parse_variant(CFG, "attention_block=0,tie_embeddings=true,remat=layer")
    assert (cfg.attention_block, cfg.tie_embeddings, cfg.remat) == (0, True, "layer")
    assert parse_variant(CFG, "") == CFG
    with pytest.raises(SystemExit, match="'atention_block' is not a model setting"):
        parse_variant(CFG, "atention_block=0")


def test_peak_takes_part_in_the_race_and_drops_its_warm_up_turns():
    from recipes.bench import peak_runner, race, raced_peak

    peak = peak_runner(with_torch=True, n=64, calls=2)
    race({"(peak)": peak["step"]}, warmup=1, repeats=3)
    assert set(peak["rates"]) == {"jax", "torch"} and all(len(r) == 4 for r in peak["rates"].values())
    assert all(rate > 0 for r in peak["rates"].values() for rate in r)
    assert raced_peak({"jax": [1.0, 5.0, 2.0, 3.0]}, warmup=1) == {"jax": 3.0}  # the warm-up turn (1.0) is not counted


def test_missing_torch_is_a_one_line_error_naming_the_fix(monkeypatch):
    import importlib.util

    from recipes import bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[torch\]', or pass --no-torch"):
        bench.main(["--shapes", "issue"])


@pytest.mark.parametrize("module,argv", [("bench", ["--repeats", "0"]), ("bench_gpu", ["--tiny", "--batch", "0"])])
def test_impossible_counts_are_usage_errors(module, argv, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(f"recipes.{module}").main(argv)
    assert exit_info.value.code == 2 and "must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["bench", "bench_gpu"])
def test_the_json_folder_is_made_up_front_or_fails_before_any_timing(module, tmp_path):
    import importlib

    from recipes.bench import prepare_output_folder

    prepare_output_folder(str(tmp_path / "runs" / "bench.json"))  # a fresh clone has no runs/ yet
    assert (tmp_path / "runs").is_dir()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="cannot create the folder .*; choose another path"):
        importlib.import_module(f"recipes.{module}").main(["--json", str(tmp_path / "a-file" / "out.json")])


def test_a_variant_value_of_the_wrong_type_is_a_one_line_error():
    from recipes.bench import SHAPES, parse_variant

    cfg = SHAPES["issue"][0]
    assert parse_variant(cfg, "attention_block=64,remat=layer").attention_block == 64
    with pytest.raises(SystemExit, match=r"attention_block='abc' must be of type int, e.g. attention_block=128"):
        parse_variant(cfg, "attention_block=abc")
