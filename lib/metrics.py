"""Throughput and utilisation (FLOPs, MFU) and the sinks metrics go to: console, JSONL, W&B.

Only process 0 writes; every sink failure except the JSONL file's is reported
and then ignored, because a dashboard outage must never stop training.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from lib.config import ModelConfig

# Dense peak FLOP/s per chip in bf16 (vendor figures), matched against `device_kind`.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (every matmul weight, LM head included) + causal-free attention 12*L*T*d."""
    d, f, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    hd = d // cfg.n_heads
    per_layer = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2 + 3 * d * f  # q,o + k,v + swiglu
    matmul_params = L * per_layer + d * V
    return 6.0 * matmul_params + 12.0 * L * seq_len * d


def lookup_peak_flops(device_kind: str) -> float | None:
    for name, peak in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if name.lower() in device_kind.lower():
            return peak
    return None


def measure_matmul_peak(n: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of a square fp32 matmul on the default device: the CPU's practical peak."""
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times)  # the best repeat: a peak, not a typical time


def peak_flops_per_device(configured: float = 0.0) -> tuple[float, str]:
    if configured > 0:
        return configured, "configured"
    kind = jax.devices()[0].device_kind
    peak = lookup_peak_flops(kind)
    if peak:
        return peak, f"{kind} table"
    return measure_matmul_peak(), f"{kind} measured fp32 matmul"


def peak_memory_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


class MetricsWriter:
    """metrics.jsonl plus W&B (offline by default); a no-op on processes other than 0."""

    def __init__(self, run_dir: str | Path, *, enabled: bool, wandb_mode: str, project: str, name: str, config: dict, resume: bool):
        self.enabled = enabled
        self.run = None
        if not enabled:
            return
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")
        if wandb_mode != "disabled":
            try:
                import wandb

                self.run = wandb.init(
                    project=project, name=name or Path(run_dir).name, dir=str(run_dir), mode=wandb_mode,
                    config=config, resume="allow" if resume else None, id=_wandb_id(run_dir),
                    settings=wandb.Settings(silent=True, console="off"),
                )
            except Exception as exc:  # W&B trouble must not stop training
                print(f"warning: W&B disabled ({type(exc).__name__}: {exc})", file=sys.stderr)

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items() if v is not None}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.run is not None:
            try:
                self.run.log({k: v for k, v in clean.items() if k != "step" and isinstance(v, (int, float))}, step=clean["step"])
            except Exception as exc:
                print(f"warning: W&B log failed, continuing without it ({exc})", file=sys.stderr)
                self.run = None

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as exc:
                print(f"warning: W&B finish failed ({exc})", file=sys.stderr)


def _wandb_id(run_dir: str | Path) -> str:
    """One W&B run per run_dir, so a resumed run continues the same curves."""
    path = Path(run_dir) / "wandb_id.txt"
    if path.is_file():
        return path.read_text().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id)
    return run_id


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file ([] if absent); a line torn by a kill mid-write is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")
