"""keep_freed_memory: a jitted program whose scratch space is larger than glibc's mmap threshold stops
page-faulting it in on every call. Each case runs in a fresh process, as the setting must precede JAX's threads."""

import os
import platform
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# Runs a program with ~72 MB of scratch space 24 times; prints the scratch pages and the median
# minor page faults of the last 12 calls (the heap settles on its high-water mark in the first few).
PROGRAM = """
import resource, statistics, sys
from lib.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.cumsum(jnp.exp(x)) + jnp.cumsum(jnp.sin(x))[::-1])
x = jnp.ones(8 * 2**20)
scratch = f.lower(x).compile().memory_analysis().temp_size_in_bytes
faults = []
for _ in range(24):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(scratch // 4096, statistics.median(faults[12:]))
"""


def scratch_pages_and_faults(mode: str) -> tuple[int, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**env, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    pages, faults = out.stdout.split()
    return int(pages), float(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc malloc's")
def test_kept_memory_is_not_faulted_in_again_on_every_call():
    pages, faults_default = scratch_pages_and_faults("default")
    assert pages > 32 * 2**20 // 4096  # above glibc's largest mmap threshold: the case that matters
    assert faults_default > pages / 2  # glibc's default: fresh pages every call (so this test can fail)
    _, faults_kept = scratch_pages_and_faults("keep")
    assert faults_kept < pages / 100
