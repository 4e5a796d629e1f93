"""Joining a multi-process run (jax.distributed) and assembling global batches from per-process rows.

Where the processes come from:
    explicit  parallel.coordinator / num_processes / process_id, or JAX_COORDINATOR_ADDRESS,
              JAX_NUM_PROCESSES, JAX_PROCESS_ID (set by launch/local.py and launch/slurm.sbatch)
    slurm     srun's SLURM_NTASKS / SLURM_PROCID, coordinator = first host of the step's node list
    tpu       a Cloud TPU VM pod: JAX reads the workers from the VM's metadata
    none      one process

JAX's own join aborts the process with a C++ stack trace when a peer never
arrives. So before it, the processes meet at a small TCP rendezvous on the
coordinator's port + 1: process 0 waits for every peer, checks they agree on
the process count, and answers ok or the problem. Every failure is then a
one-line `DistributedError` after at most `parallel.init_timeout_s`, not a hang.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import jax
import numpy as np

from lib.config import ParallelConfig

CLUSTERS = ("auto", "explicit", "slurm", "tpu", "none")


class DistributedError(RuntimeError):
    """A multi-process run that cannot start; the message names the fix."""


@dataclass(frozen=True)
class ClusterSpec:
    kind: str  # explicit | slurm | tpu
    coordinator: str | None = None  # host:port of process 0; None: JAX finds it (tpu)
    num_processes: int | None = None
    process_id: int | None = None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    m = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist.strip())
    if not m:
        raise DistributedError(f"cannot read a host from SLURM node list {nodelist!r}; set JAX_COORDINATOR_ADDRESS=host:port")
    return m.group(1) + (m.group(2) or "")


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    if value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer; fix the launcher's environment") from None


def _agree(what: str, configured: int, from_env: int | None, env_name: str) -> int | None:
    """A setting given both in config and by the launcher must agree."""
    if configured >= 0 and from_env is not None and configured != from_env:
        raise DistributedError(
            f"parallel.{what}={configured} but the launcher set {env_name}={from_env}; "
            f"drop parallel.{what} or launch {configured} processes"
        )
    return configured if configured >= 0 else from_env


def on_tpu_vm(env: Mapping[str, str]) -> bool:
    return any(k in env for k in ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE")) or Path("/dev/accel0").exists()


def detect_cluster(cfg: ParallelConfig, env: Mapping[str, str] = os.environ) -> ClusterSpec | None:
    """How this process joins the run, or None when it runs alone."""
    if cfg.cluster not in CLUSTERS:
        raise DistributedError(f"parallel.cluster={cfg.cluster!r}: choose one of {', '.join(CLUSTERS)}")
    num_cfg = cfg.num_processes if cfg.num_processes > 0 else -1
    coordinator = cfg.coordinator or env.get("JAX_COORDINATOR_ADDRESS", "")
    slurm = cfg.cluster == "slurm" or (cfg.cluster == "auto" and (_int_env(env, "SLURM_NTASKS") or 1) > 1)
    if cfg.cluster == "explicit" or (cfg.cluster == "auto" and coordinator):
        kind = "explicit"
        num = _agree("num_processes", num_cfg, _int_env(env, "JAX_NUM_PROCESSES"), "JAX_NUM_PROCESSES")
        pid = _agree("process_id", cfg.process_id, _int_env(env, "JAX_PROCESS_ID"), "JAX_PROCESS_ID")
    elif slurm:
        kind = "slurm"
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodes or "SLURM_PROCID" not in env:
            raise DistributedError("parallel.cluster=slurm but SLURM_PROCID / SLURM_JOB_NODELIST are unset; start the recipe with srun")
        # The same port rule as JAX's own SLURM detection, so both agree on the coordinator.
        port = env.get("JAX_COORDINATOR_PORT") or str(int(env.get("SLURM_JOB_ID", "0")) % 4096 + 61440)
        coordinator = coordinator or f"{first_slurm_host(nodes)}:{port}"
        num = _agree("num_processes", num_cfg, _int_env(env, "SLURM_NTASKS"), "SLURM_NTASKS")
        pid = _agree("process_id", cfg.process_id, _int_env(env, "SLURM_PROCID"), "SLURM_PROCID")
    elif cfg.cluster == "tpu" or (cfg.cluster == "auto" and on_tpu_vm(env)):
        return ClusterSpec("tpu")
    else:
        if num_cfg > 1:
            raise DistributedError(
                f"parallel.num_processes={num_cfg} but no coordinator is set; set parallel.coordinator=HOST:PORT "
                "or start the processes with launch/local.py, launch/slurm.sbatch or launch/tpu_pod.py"
            )
        return None
    if not coordinator or ":" not in coordinator:
        raise DistributedError(f"coordinator address {coordinator!r} is not HOST:PORT; set parallel.coordinator or JAX_COORDINATOR_ADDRESS")
    if num is None or pid is None:
        raise DistributedError("a coordinator is set but the process count or id is not; set JAX_NUM_PROCESSES and JAX_PROCESS_ID (or parallel.*)")
    if not 0 <= pid < num:
        raise DistributedError(f"process id {pid} is outside 0..{num - 1} for {num} processes; give each process a distinct id below the count")
    return ClusterSpec(kind, coordinator, num, pid)


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def _serve_rendezvous(port: int, spec: ClusterSpec, timeout_s: float) -> None:
    """Process 0: wait for every peer, check they agree, answer everyone with ok or the problem."""
    deadline = time.monotonic() + timeout_s
    peers: dict[int, socket.socket] = {}
    problem = ""
    with socket.create_server(("", port)) as server:
        server.settimeout(0.2)
        while len(peers) < spec.num_processes - 1 and not problem and time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            conn.settimeout(max(deadline - time.monotonic(), 1.0))
            try:
                hello = json.loads(conn.makefile().readline())
            except (OSError, ValueError):
                conn.close()
                continue
            pid, num = hello.get("process_id"), hello.get("num_processes")
            if num != spec.num_processes:
                problem = f"process {pid} was started for {num} processes but process 0 for {spec.num_processes}; start every process with the same count"
            elif not isinstance(pid, int) or pid in peers or not 0 < pid < spec.num_processes:
                problem = f"two processes claim id {pid} (or it is out of range); give each process a distinct id in 0..{spec.num_processes - 1}"
            peers[pid if isinstance(pid, int) and pid not in peers else -len(peers) - 1] = conn  # keep it to answer
        missing = sorted(set(range(1, spec.num_processes)) - set(peers))
        if not problem and missing:
            problem = (
                f"only {spec.num_processes - len(missing)} of {spec.num_processes} processes joined within {timeout_s:.0f}s "
                f"(missing ids {missing[:8]}); start all {spec.num_processes} processes (the launcher's count must match), "
                "or raise parallel.init_timeout_s"
            )
        for conn in peers.values():
            try:
                _send(conn, {"error": problem} if problem else {"ok": True})
            except OSError:
                pass
            conn.close()
    if problem:
        raise DistributedError(problem)


def _join_rendezvous(host: str, port: int, spec: ClusterSpec, timeout_s: float) -> None:
    """Peers: reach process 0 (retrying while it starts) and wait for its verdict."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection((host, port), timeout=1.0)
        except OSError:
            time.sleep(0.2)
            continue
        with conn:
            _send(conn, {"process_id": spec.process_id, "num_processes": spec.num_processes})
            # Process 0 answers by the end of its own timeout, which may have started after ours.
            conn.settimeout(timeout_s + 10)
            try:
                line = conn.makefile().readline()
            except OSError:
                line = ""
        if not line:
            raise DistributedError(f"the coordinator {host} (process 0) closed the connection without an answer; see its error")
        answer = json.loads(line)
        if answer.get("ok"):
            return
        raise DistributedError(answer.get("error", "the coordinator refused this process"))
    raise DistributedError(
        f"cannot reach the coordinator {host} (process 0, rendezvous port {port}) within {timeout_s:.0f}s; "
        "start process 0, check parallel.coordinator / JAX_COORDINATOR_ADDRESS and firewalls, or raise parallel.init_timeout_s"
    )


def rendezvous_port(coordinator_port: int) -> int:
    """The pre-flight port: the coordinator's + 1 (- 1 at the top of the range); every process agrees."""
    return coordinator_port + 1 if coordinator_port < 65535 else coordinator_port - 1


def initialize(cfg: ParallelConfig) -> ClusterSpec | None:
    """Join the multi-process run this process belongs to (no-op when alone or already joined)."""
    spec = detect_cluster(cfg)
    if spec is None or jax.distributed.is_initialized():
        return spec
    if spec.kind == "tpu":
        jax.distributed.initialize(initialization_timeout=cfg.init_timeout_s)
        return spec
    host, port = spec.coordinator.rsplit(":", 1)
    check_port = rendezvous_port(int(port))
    if spec.num_processes > 1:
        if spec.process_id == 0:
            _serve_rendezvous(check_port, spec, cfg.init_timeout_s)
        else:
            _join_rendezvous(host, check_port, spec, cfg.init_timeout_s)
    jax.distributed.initialize(
        spec.coordinator, spec.num_processes, spec.process_id, initialization_timeout=cfg.init_timeout_s
    )
    if jax.process_count() != spec.num_processes:
        raise DistributedError(f"JAX sees {jax.process_count()} processes but {spec.num_processes} were launched; restart them all with one count")
    return spec


def global_batch(local_rows: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """This process's rows -> global arrays; process p's rows are block p of the global batch
    (lib/data.py gives process p exactly those rows, so the batch is the same for any process count)."""
    n = jax.process_count()
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (v.shape[0] * n, *v.shape[1:]))
        for k, v in local_rows.items()
    }


def same_on_every_process(rows: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Rows every process holds in full (validation batches) -> global arrays, each device taking its part."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index]) for k, v in rows.items()}
