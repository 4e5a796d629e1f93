"""Submit launch/slurm.sbatch with the allocation spelled out: nodes, GPUs per node, one process per GPU or per node.

    python -m launch.slurm --nodes 2 -- +exp=llama3_8b_h100 data.sources.0.path=/data/corpus
    python -m launch.slurm --nodes 8 --per node --partition gpu --dry-run -- +exp=llama3_70b_h100
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

SBATCH_SCRIPT = Path(__file__).resolve().parent / "slurm.sbatch"


def sbatch_command(ns) -> list[str]:
    tasks_per_node = ns.gpus_per_node if ns.per == "gpu" else 1
    cmd = [
        "sbatch", f"--nodes={ns.nodes}", f"--ntasks-per-node={tasks_per_node}", f"--gpus-per-node={ns.gpus_per_node}",
        f"--time={ns.time}", f"--job-name={ns.job_name}", f"--export=ALL,PROCESS_PER={ns.per}",
    ]
    if ns.partition:
        cmd.append(f"--partition={ns.partition}")
    return [*cmd, str(SBATCH_SCRIPT), *ns.args]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--per", choices=("gpu", "node"), default="gpu", help="one process per GPU or per node")
    parser.add_argument("--partition", default="")
    parser.add_argument("--time", default="48:00:00")
    parser.add_argument("--job-name", default="jaxpretrain")
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch command instead of submitting it")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the recipe's overrides")
    ns = parser.parse_args(argv)
    ns.args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if ns.nodes < 1 or ns.gpus_per_node < 1:
        print("error: --nodes and --gpus-per-node must be at least 1", file=sys.stderr)
        return 2
    cmd = sbatch_command(ns)
    if ns.dry_run:
        print(shlex.join(cmd))
        return 0
    if shutil.which("sbatch") is None:
        print("error: sbatch is not on PATH; run this on a SLURM login node (or use --dry-run to see the command)", file=sys.stderr)
        return 2
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
