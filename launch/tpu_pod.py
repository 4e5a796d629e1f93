"""Run a recipe on a Cloud TPU VM pod: create (or reuse) it, copy the code, install, run on every worker.

    python -m launch.tpu_pod --name my-v5p --zone us-east5-a --accelerator v5p-256 -- +exp=llama3_8b_v5p
    python -m launch.tpu_pod ... --dry-run      # print the gcloud commands instead of running them
    python -m launch.tpu_pod ... --teardown     # delete the pod when the run ends (also after a failure)

Every worker runs the same command; `parallel.cluster=tpu` makes each process
join through JAX's TPU detection (the VM metadata names the workers). Output
of all workers streams here through `gcloud ... ssh --worker=all`, and each
worker also keeps it in ~/jaxpretrain-run.log. `run_dir` must be storage every
worker sees at the same path (e.g. a gcsfuse-mounted bucket): Orbax writes
each host's shards there.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys

REMOTE_DIR = "~/jaxpretrain"
ARCHIVE = "jaxpretrain.tar.gz"


def _where(ns) -> list[str]:
    return [f"--zone={ns.zone}"] + ([f"--project={ns.project}"] if ns.project else [])


def pod_commands(ns) -> dict[str, list[str]]:
    tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
    local_archive = f"/tmp/{ns.name}-{ARCHIVE}"
    recipe = ["python", "-m", ns.module, "parallel.cluster=tpu", *ns.args]
    remote_run = f"set -o pipefail && cd {REMOTE_DIR} && {shlex.join(recipe)} 2>&1 | tee -a ~/jaxpretrain-run.log"
    install = f"mkdir -p {REMOTE_DIR} && tar xzf ~/{ARCHIVE} -C {REMOTE_DIR} && cd {REMOTE_DIR} && pip install -q -e '.[tpu]'"
    return {
        "describe": [*tpu, "describe", ns.name, *_where(ns), "--format=value(state)"],
        "create": [*tpu, "create", ns.name, *_where(ns), f"--accelerator-type={ns.accelerator}", f"--version={ns.version}", *(["--spot"] if ns.spot else [])],
        # Tracked and untracked-but-not-ignored files: what `git status` shows, without runs/ or caches.
        "package": ["sh", "-c", f"git ls-files -co --exclude-standard | tar czf {local_archive} -T -"],
        "copy": [*tpu, "scp", local_archive, f"{ns.name}:~/{ARCHIVE}", "--worker=all", *_where(ns)],
        "install": [*tpu, "ssh", ns.name, "--worker=all", *_where(ns), f"--command={install}"],
        "run": [*tpu, "ssh", ns.name, "--worker=all", *_where(ns), f"--command={remote_run}"],
        "teardown": [*tpu, "delete", ns.name, *_where(ns), "--quiet"],
    }


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m launch.tpu_pod", description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="TPU VM name (reused if it exists)")
    parser.add_argument("--zone", required=True)
    parser.add_argument("--accelerator", default="v5p-8", help="accelerator type, e.g. v5p-256, v4-64, v5litepod-16")
    parser.add_argument("--version", default="v2-alpha-tpuv5", help="TPU VM software version (v4: tpu-ubuntu2204-base)")
    parser.add_argument("--project", default="", help="GCP project (default: gcloud's)")
    parser.add_argument("--spot", action="store_true", help="create a Spot (preemptible) pod")
    parser.add_argument("--module", default="recipes.pretrain")
    parser.add_argument("--teardown", action="store_true", help="delete the pod when the run ends")
    parser.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the recipe's overrides")
    ns = parser.parse_args(argv)
    ns.args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    cmds = pod_commands(ns)
    if ns.dry_run:
        print(f"# reuse the pod if this succeeds:\n{shlex.join(cmds['describe'])}")
        print(f"# otherwise create it:\n{shlex.join(cmds['create'])}")
        for step in ("package", "copy", "install", "run") + (("teardown",) if ns.teardown else ()):
            print(f"# {step}:\n{shlex.join(cmds[step])}")
        return 0
    if shutil.which("gcloud") is None:
        print("error: gcloud is not on PATH; install the Google Cloud SDK (or use --dry-run to see the commands)", file=sys.stderr)
        return 2
    exists = subprocess.run(cmds["describe"], capture_output=True, text=True).returncode == 0
    status = 0
    try:
        for step in ([] if exists else ["create"]) + ["package", "copy", "install", "run"]:
            print(f"launch.tpu_pod: {step}", file=sys.stderr)
            status = subprocess.run(cmds[step]).returncode
            if status:
                print(f"error: step '{step}' failed with status {status}: {shlex.join(cmds[step])}", file=sys.stderr)
                break
    finally:
        if ns.teardown:
            subprocess.run(cmds["teardown"])
    return status


if __name__ == "__main__":
    sys.exit(main())
