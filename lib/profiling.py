"""A jax.profiler trace of a window of training steps (`trainer.profile_start`, `trainer.profile_steps`).

The window starts after step `profile_start`, so compilation and warm-up stay out of it,
and covers `profile_steps` optimizer steps, each marked with a step annotation. Every process
writes its own trace to `<run_dir>/profile/process-<i>/`: XLA's ops per thread (TensorBoard's
profile plugin reads the `.xplane.pb`) and `perfetto_trace.json.gz`, which https://ui.perfetto.dev
opens in the browser without uploading it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax


class StepProfiler:
    """Starts the trace before the window's first step and stops it after its last (or at close)."""

    def __init__(self, run_dir: Path, start_after: int, steps: int, process_index: int):
        self.first, self.last = start_after + 1, start_after + steps
        self.enabled = start_after > 0
        self.folder = Path(run_dir) / "profile" / f"process-{process_index}"
        self.active = False

    def step(self, step: int):
        """Context for one optimizer step: starts the trace at the window's first step, annotates the steps in it."""
        if self.enabled and not self.active and self.first <= step <= self.last:
            self.folder.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
            self.active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step) if self.active else contextlib.nullcontext()

    def after(self, step: int) -> Path | None:
        """Call once the step's results are on the host; returns the Perfetto trace when the window just closed."""
        if self.active and step >= self.last:
            return self.close()
        return None

    def close(self) -> Path | None:
        if not self.active:
            return None
        jax.profiler.stop_trace()
        self.active, self.enabled = False, False  # one window per run (a rollback replays steps: no second trace)
        traces = sorted(self.folder.glob("plugins/profile/*/perfetto_trace.json.gz"))  # one timestamped folder per trace
        return traces[-1] if traces else self.folder
