"""The launchers' dry runs print the exact commands; without their cloud tools they fail in one line."""

from __future__ import annotations

import shlex
import subprocess
import sys

from launch import local, slurm, tpu_pod
from multidevice import REPO, subprocess_env


def test_local_dry_run_prints_one_command_per_process(capsys):
    assert local.main(["--processes", "3", "--devices-per-process", "4", "--port", "4321", "--dry-run", "--", "+exp=smoke", "parallel=fsdp"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines):
        words = shlex.split(line)
        assert words[0] == "env" and words[-4:] == ["-m", "recipes.pretrain", "+exp=smoke", "parallel=fsdp"]
        assert {"JAX_NUM_CPU_DEVICES=4", "JAX_COORDINATOR_ADDRESS=127.0.0.1:4321", "JAX_NUM_PROCESSES=3", f"JAX_PROCESS_ID={i}"} <= set(words)


def test_local_rejects_zero_processes(capsys):
    assert local.main(["--processes", "0", "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_tpu_pod_dry_run_creates_copies_installs_runs_and_tears_down(capsys):
    argv = ["--name", "pod", "--zone", "us-east5-a", "--accelerator", "v5p-256", "--project", "proj", "--teardown", "--dry-run",
            "--", "+exp=llama3_8b_v5p", "run_dir=/mnt/runs/a"]
    assert tpu_pod.main(argv) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert [c[:5] for c in commands if c[0] == "gcloud"] == [["gcloud", "compute", "tpus", "tpu-vm", v] for v in ("describe", "create", "scp", "ssh", "ssh", "delete")]
    create, run = commands[1], commands[5]
    assert "--accelerator-type=v5p-256" in create and "--zone=us-east5-a" in create and "--project=proj" in create
    assert "--worker=all" in run
    remote = next(w for w in run if w.startswith("--command=")).removeprefix("--command=")
    assert "python -m recipes.pretrain parallel.cluster=tpu +exp=llama3_8b_v5p run_dir=/mnt/runs/a" in remote
    assert "git ls-files" in commands[2][2]


def test_tpu_pod_without_gcloud_is_a_one_line_error():
    env = subprocess_env(PATH="/nonexistent")
    result = subprocess.run([sys.executable, "-m", "launch.tpu_pod", "--name", "p", "--zone", "z", "--", "+exp=smoke"],
                            cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "gcloud is not on PATH" in result.stderr


def test_slurm_helper_dry_run_spells_out_the_allocation(capsys):
    assert slurm.main(["--nodes", "4", "--per", "node", "--partition", "h100", "--dry-run", "--", "+exp=llama3_70b_h100"]) == 0
    words = shlex.split(capsys.readouterr().out)
    assert words[0] == "sbatch" and words[-1] == "+exp=llama3_70b_h100" and words[-2].endswith("launch/slurm.sbatch")
    assert {"--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=h100", "--export=ALL,PROCESS_PER=node"} <= set(words)


def test_slurm_batch_script_sets_the_coordinator_from_slurm_variables():
    env = subprocess_env(DRY_RUN="1", SLURM_JOB_NODELIST="gpu[07-08]", SLURM_NTASKS="16", SLURM_JOB_ID="100", PATH="/usr/bin:/bin", PYTHON=sys.executable)
    result = subprocess.run(["bash", "launch/slurm.sbatch", "+exp=llama3_8b_h100", "run_dir=/shared/a"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    assert words[:3] == ["env", "JAX_COORDINATOR_ADDRESS=gpu07:61540", "JAX_NUM_PROCESSES=16"]
    assert words[3:5] == ["srun", "--kill-on-bad-exit=1"] and words[-2:] == ["+exp=llama3_8b_h100", "run_dir=/shared/a"]
    task = words[7]  # bash -c TASK: the per-task id comes from srun's SLURM_PROCID
    assert "JAX_PROCESS_ID=$SLURM_PROCID" in task and "JAX_LOCAL_DEVICE_IDS=$SLURM_LOCALID" in task and "recipes.pretrain" in task
