"""Start N processes of a recipe on this machine, joined by JAX's distributed runtime over localhost.

    python -m launch.local --processes 2 --devices-per-process 4 -- +exp=smoke parallel=fsdp
    python -m launch.local --processes 2 --dry-run -- +exp=smoke parallel=fsdp   # print the commands

Each process sees `--devices-per-process` CPU devices (XLA's CPU collectives,
gloo, carry the traffic between processes), so the multi-host code path runs
on one laptop exactly as it will on a pod. Process 0's output is passed
through; the others' lines are prefixed with `[process i]`. When one process
fails, the rest are stopped and the launcher exits with the failure's status.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 15.0  # after one process fails, how long the others get to report their own error


def free_port_pair() -> int:
    """A port p with p and p + 1 free (JAX's coordinator and the pre-flight rendezvous)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("found no two adjacent free ports on 127.0.0.1; pass --port")


def process_env(i: int, n: int, devices: int, port: int) -> dict[str, str]:
    return {
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(devices),
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": str(n),
        "JAX_PROCESS_ID": str(i),
    }


def commands(n: int, devices: int, port: int, module: str, args: list[str]) -> list[tuple[dict[str, str], list[str]]]:
    return [(process_env(i, n, devices, port), [sys.executable, "-m", module, *args]) for i in range(n)]


def shell_line(env: dict[str, str], argv: list[str]) -> str:
    return " ".join(["env", *(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])


def _prefix_lines(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(prefix + line)
        out.flush()


def run(cmds: list[tuple[dict[str, str], list[str]]]) -> int:
    procs = []
    for i, (env, argv) in enumerate(cmds):
        if i == 0:
            procs.append(subprocess.Popen(argv, env={**os.environ, **env}))
            continue
        p = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=_prefix_lines, args=(p.stdout, f"[process {i}] ", sys.stderr), daemon=True).start()
        procs.append(p)
    failed_at = None
    while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for p in procs:
                if p.poll() is None:
                    p.terminate()  # only our own children
            break
        time.sleep(0.1)
    codes = [p.wait() for p in procs]
    bad = [c for c in codes if c != 0]
    if bad:
        print(f"launch.local: exit statuses {codes}", file=sys.stderr)
        return next((c for c in bad if c > 0), 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.local", description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="number of processes")
    parser.add_argument("--devices-per-process", type=int, default=1, help="simulated CPU devices in each process")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: pick a free one; port+1 is used too)")
    parser.add_argument("--module", default="recipes.pretrain", help="the recipe module to run")
    parser.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the recipe's overrides")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if ns.processes < 1 or ns.devices_per_process < 1:
        print("error: --processes and --devices-per-process must be at least 1", file=sys.stderr)
        return 2
    port = ns.port or free_port_pair()
    cmds = commands(ns.processes, ns.devices_per_process, port, ns.module, args)
    if ns.dry_run:
        for env, cmd in cmds:
            print(shell_line(env, cmd))
        return 0
    return run(cmds)


if __name__ == "__main__":
    sys.exit(main())
