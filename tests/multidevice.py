"""Helpers for tests that need several (simulated) devices or processes: they run recipes in subprocesses,
because the pytest process may already have started JAX with one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAUNCH_VARIABLES = ("JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                    "JAX_LOCAL_DEVICE_IDS", "SLURM_", "TPU_")


def subprocess_env(devices: int | None = None, jax_cache: Path | None = None, **extra: str) -> dict[str, str]:
    # Drop what says how many devices or processes there are; keep e.g. the suite's compilation cache.
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    env["JAX_PLATFORMS"] = "cpu"
    if devices:
        env["JAX_NUM_CPU_DEVICES"] = str(devices)
    if jax_cache:
        # Runs that compile the same program (a resume on the same device count) reuse it.
        env.update(JAX_COMPILATION_CACHE_DIR=str(jax_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.update(extra)
    return env


def start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: dict[str, subprocess.Popen], timeout: float = 600) -> dict[str, subprocess.CompletedProcess]:
    """Wait for every process (they run concurrently); a failure shows its output."""
    done = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=timeout)
        done[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return done


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)
