

from lib.config import ModelConfig
from lib.metrics import MetricsWriter, flops_per_token, lookup_peak_flops, read_metrics


def test_flops_per_token_counts_matmuls_and_attention():
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=100)
    # per layer: q,o 64x64 each, k,v 64x32 each, SwiGLU 3 x 64x128; plus the LM head 64x100
    matmul_params = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 64 * 100
    assert flops_per_token(cfg, seq_len=16) == 6 * matmul_params + 12 * 2 * 16 * 64


def test_peak_table_matches_device_kinds():
    assert lookup_peak_flops("TPU v5p") == 459e12
    assert lookup_peak_flops("TPU v5 lite") == 197e12
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert lookup_peak_flops("cpu") is None


def test_wandb_failure_never_stops_training(tmp_path, monkeypatch, capsys):
    import wandb

    def broken_init(**kwargs):
        raise RuntimeError("no W&B today")

    monkeypatch.setattr(wandb, "init", broken_init)
    writer = MetricsWriter(tmp_path, enabled=True, wandb_mode="online", project="p", name="n", config={}, resume=False)
    writer.write({"step": 1, "loss": 2.5})
    writer.close()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.5}]
    assert "W&B disabled" in capsys.readouterr().err


def test_only_process_zero_writes(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=False, wandb_mode="offline", project="p", name="n", config={}, resume=False)
    writer.write({"step": 1, "loss": 1.0})
    writer.close()
    assert not (tmp_path / "metrics.jsonl").exists()
