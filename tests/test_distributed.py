"""Joining a multi-process run: cluster detection, the pre-flight rendezvous, and its one-line errors."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from lib import distributed
from lib.config import ParallelConfig
from lib.distributed import ClusterSpec, DistributedError, detect_cluster, first_slurm_host
from multidevice import finish, start, subprocess_env

FSDP = ParallelConfig(name="fsdp", fsdp=-1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "nodelist, host",
    [("node001", "node001"), ("node001,host2", "node001"), ("gpu[003-005,9],cpu1", "gpu003"), ("n[7]", "n7")],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_rendezvous_port_stays_in_range():
    assert distributed.rendezvous_port(1234) == 1235 and distributed.rendezvous_port(65535) == 65534


def test_one_process_needs_nothing():
    assert detect_cluster(FSDP, {}) is None


def test_explicit_coordinator_from_the_launchers_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert detect_cluster(FSDP, env) == ClusterSpec("explicit", "10.0.0.1:1234", 4, 3)
    cfg = ParallelConfig(name="fsdp", coordinator="h:1", num_processes=2, process_id=1)
    assert detect_cluster(cfg, {}) == ClusterSpec("explicit", "h:1", 2, 1)


def test_slurm_is_detected_with_jaxs_port_rule():
    env = {"SLURM_NTASKS": "16", "SLURM_PROCID": "5", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "7"}
    assert detect_cluster(FSDP, env) == ClusterSpec("slurm", "gpu01:61447", 16, 5)
    assert detect_cluster(FSDP, {**env, "SLURM_NTASKS": "1"}) is None  # a one-task job runs alone


def test_tpu_pod_leaves_the_addresses_to_jax():
    assert detect_cluster(FSDP, {"TPU_WORKER_HOSTNAMES": "w0,w1"}) == ClusterSpec("tpu")
    assert detect_cluster(ParallelConfig(name="fsdp", cluster="tpu"), {}) == ClusterSpec("tpu")


@pytest.mark.parametrize(
    "cfg, env, message",
    [
        (ParallelConfig(name="fsdp", num_processes=3), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
         "parallel.num_processes=3 but the launcher set JAX_NUM_PROCESSES=2"),
        (FSDP, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, "process count or id is not"),
        (FSDP, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "outside 0..1"),
        (FSDP, {"JAX_COORDINATOR_ADDRESS": "nohost", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "not HOST:PORT"),
        (FSDP, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "not an integer"),
        (ParallelConfig(name="fsdp", num_processes=4), {}, "no coordinator is set"),
        (ParallelConfig(name="fsdp", cluster="mpi"), {}, "choose one of"),
    ],
)
def test_inconsistent_settings_are_one_line_errors(cfg, env, message):
    with pytest.raises(DistributedError, match=message) as info:
        detect_cluster(cfg, env)
    assert "\n" not in str(info.value)


def rendezvous(n: int, port: int, ids_and_counts: list[tuple[int, int]], timeout: float) -> dict:
    """Process 0 (count n) and the given peers, each in a thread; returns id -> None or the error."""
    results = {}

    def process_zero():
        try:
            distributed._serve_rendezvous(port, ClusterSpec("explicit", f"127.0.0.1:{port - 1}", n, 0), timeout)
            results[0] = None
        except DistributedError as exc:
            results[0] = str(exc)

    def peer(pid, count):
        try:
            distributed._join_rendezvous("127.0.0.1", port, ClusterSpec("explicit", f"127.0.0.1:{port - 1}", count, pid), timeout)
            results[pid] = None
        except DistributedError as exc:
            results[pid] = str(exc)

    threads = [threading.Thread(target=process_zero)] + [threading.Thread(target=peer, args=p) for p in ids_and_counts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return results


def test_rendezvous_lets_a_complete_group_through():
    assert rendezvous(3, free_port(), [(1, 3), (2, 3)], timeout=20) == {0: None, 1: None, 2: None}


def test_rendezvous_rejects_a_process_count_mismatch_everywhere():
    results = rendezvous(3, free_port(), [(1, 2)], timeout=20)
    assert "started for 2 processes but process 0 for 3" in results[0] and results[0] == results[1]


def test_rendezvous_times_out_when_a_process_is_missing():
    t0 = time.monotonic()
    results = rendezvous(3, free_port(), [(1, 3)], timeout=1.5)
    assert time.monotonic() - t0 < 10
    assert "only 2 of 3 processes joined within 2s (missing ids [2])" in results[0]
    assert results[1] == results[0]  # the peer that came learns why


def test_unreachable_coordinator_is_a_timeout_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match="cannot reach the coordinator 127.0.0.1 .* within 1s"):
        distributed._join_rendezvous("127.0.0.1", free_port(), ClusterSpec("explicit", "x:1", 2, 1), 1.0)
    assert time.monotonic() - t0 < 5


def test_recipe_reports_an_unreachable_coordinator_in_one_line(tmp_path):
    port = free_port()
    env = subprocess_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
    t0 = time.monotonic()
    result = finish({"p1": start(["-m", "recipes.pretrain", "+exp=smoke", "parallel=fsdp", "parallel.init_timeout_s=2",
                                  f"run_dir={tmp_path / 'run'}"], env)}, timeout=120)["p1"]
    assert result.returncode == 2 and time.monotonic() - t0 < 60
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the coordinator"), result.stderr
    assert not (tmp_path / "run").exists()


def test_launcher_and_config_disagreeing_on_the_process_count(tmp_path):
    result = finish({"l": start(["-m", "launch.local", "--processes", "2", "--devices-per-process", "1", "--",
                                 "+exp=smoke", "parallel=fsdp", "parallel.num_processes=3", f"run_dir={tmp_path / 'run'}"],
                                subprocess_env())}, timeout=120)["l"]
    assert result.returncode == 2
    assert "error: parallel.num_processes=3 but the launcher set JAX_NUM_PROCESSES=2" in result.stderr
    assert not (tmp_path / "run").exists()


def test_global_batch_from_process_local_rows_on_one_process():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((1, 1), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:1])
    rows = {"tokens": np.arange(12, dtype=np.int32).reshape(4, 3)}
    got = distributed.global_batch(rows, NamedSharding(mesh, P(("data", "fsdp"))))
    np.testing.assert_array_equal(np.asarray(got["tokens"]), rows["tokens"])
    full = distributed.same_on_every_process(rows, NamedSharding(mesh, P()))
    np.testing.assert_array_equal(np.asarray(full["tokens"]), rows["tokens"])
