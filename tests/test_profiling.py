"""lib/profiling.py: a jax.profiler trace of exactly the chosen window of steps, each step annotated."""

import gzip
import json

import jax
import jax.numpy as jnp

from lib.profiling import StepProfiler


def traced_steps(trace_file) -> list[int]:
    data = json.load(gzip.open(trace_file))
    events = data["traceEvents"] if isinstance(data, dict) else data
    return sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train" and e.get("ph") == "X")


def run(profiler: StepProfiler, steps: int) -> list:
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((64, 64))
    closed = []
    for step in range(1, steps + 1):
        with profiler.step(step):
            f(x).block_until_ready()
        closed.append(profiler.after(step))
    return closed + [profiler.close()]


def test_the_window_after_warm_up_is_traced_and_nothing_else(tmp_path):
    closed = run(StepProfiler(tmp_path, start_after=2, steps=2, process_index=0), steps=6)
    trace = closed[3]  # returned right after step 4, the window's last
    assert [c for i, c in enumerate(closed) if i != 3] == [None] * 6
    assert trace.name == "perfetto_trace.json.gz" and (tmp_path / "profile" / "process-0") in trace.parents
    assert traced_steps(trace) == [3, 4]


def test_a_run_that_ends_inside_the_window_still_writes_its_trace(tmp_path):
    closed = run(StepProfiler(tmp_path, start_after=4, steps=3, process_index=1), steps=5)
    assert closed[:-1] == [None] * 5 and traced_steps(closed[-1]) == [5]
    assert (tmp_path / "profile" / "process-1") in closed[-1].parents


def test_profile_start_zero_traces_nothing(tmp_path):
    assert run(StepProfiler(tmp_path, start_after=0, steps=3, process_index=0), steps=4) == [None] * 5
    assert not (tmp_path / "profile").exists()
