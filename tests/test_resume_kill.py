"""Survive kills: SIGKILL the pretrain recipe mid-save and mid-step, re-run the same command, and the
continued losses equal an uninterrupted run's bit for bit.

Real subprocesses and real `kill -9`. The mid-save kill is made certain with the
`guard.fault.save_stall_s` knob (each checkpoint is fully written but waits before
its commit rename); the other kills land at randomly chosen moments while steps and
asynchronous saves are running.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from lib.config import load_config
from lib.metrics import read_metrics
from recipes import pretrain
from tests.conftest import ROOT, smoke_overrides

ARGS = ["trainer.steps=40", "trainer.ckpt_every=3", "trainer.eval_every=20", "trainer.peak_flops=1e12"]
TMP_MARKER = ".orbax-checkpoint-tmp"


def losses(rows):
    """step -> loss; a step logged twice would show up as a length mismatch against the step list."""
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "recipes.pretrain", *smoke_overrides(run_dir, *ARGS, *extra)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_until(proc: subprocess.Popen, condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before the kill point: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "the kill point never came"
        time.sleep(0.02)


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    proc.stderr.close()


def last_logged_step(run_dir: Path) -> int:
    return max(losses(read_metrics(run_dir)), default=0)


def tmp_folders(run_dir: Path) -> list[str]:
    ckpts = run_dir / "checkpoints"
    return [p.name for p in ckpts.iterdir() if TMP_MARKER in p.name] if ckpts.is_dir() else []


def test_kill_minus_9_mid_save_and_at_random_moments_then_rerun_gives_bitwise_equal_losses(tmp_path):
    reference = tmp_path / "uninterrupted"
    pretrain.train(load_config(smoke_overrides(reference, *ARGS)))
    expected = losses(read_metrics(reference))
    assert sorted(expected) == list(range(1, 41))

    run_dir = tmp_path / "killed"
    rng = random.Random(5)

    # 1. Mid-save: every commit stalls, so the first checkpoint sits written-but-uncommitted; kill it there.
    proc = start(run_dir, "guard.fault.save_stall_s=60")
    wait_until(proc, lambda: tmp_folders(run_dir))
    time.sleep(rng.uniform(0.0, 0.3))
    kill9(proc)
    assert tmp_folders(run_dir), "the kill should have left the half-saved checkpoint behind"

    # 2.-3. Two kills at random moments: mid-step, or while an async save is in flight.
    resumed_at = []
    for _ in range(2):
        target = last_logged_step(run_dir) + rng.randint(4, 10)
        proc = start(run_dir)
        wait_until(proc, lambda: last_logged_step(run_dir) >= target)
        time.sleep(rng.uniform(0.0, 0.05))
        kill9(proc)
        resumed_at.append(target)

    # 4. The same command again, to the end.
    done = subprocess.run([sys.executable, "-m", "recipes.pretrain", *smoke_overrides(run_dir, *ARGS)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stderr
    assert tmp_folders(run_dir) == []  # incomplete checkpoints are never chosen and are cleaned away
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 41)), "every step logged exactly once"
    got = losses(rows)
    assert got == expected, f"losses differ after kills near steps {resumed_at}"
