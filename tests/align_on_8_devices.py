"""recipes.align on 8 simulated devices, run in its own process by tests/test_align_parallel.py.

    JAX_NUM_CPU_DEVICES=8 python tests/align_on_8_devices.py OUT_DIR ARGS...

Runs `python -m recipes.align`'s `main` once per case below (one process: the single-device
side compiles once) and writes OUT_DIR/cases.json with each exit code, table and JSON report.
Nothing here decides pass or fail.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recipes.align import main  # noqa: E402

# Rows split over all 8 devices need 8 rows; 4 pipeline stages need a multiple of 4 layers.
CASES = {
    "fsdp": ["b.parallel=fsdp"],
    "pipeline": ["b.parallel=pipeline", "b.parallel.stages=4", "b.parallel.microbatches=4"],
    "fsdp_layer_fault": ["b.parallel=fsdp", "align.fault=layer_scale:2:1.001"],
    "fsdp_label_fault": ["b.parallel=fsdp", "align.fault=shift_labels"],
    "pipeline_grad_fault": ["b.parallel=pipeline", "b.parallel.stages=4", "b.parallel.microbatches=4",
                            "align.fault=grad_scale:blocks.mlp.w_up:3:1.01"],
}


def main_(out: Path, base: list[str]) -> None:
    import jax

    results = {"devices": jax.device_count()}
    for name, extra in CASES.items():
        report = out / f"{name}.json"
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main([*base, "trainer.batch_size=8", "model.n_layers=4", "align.steps=2", f"align.report={report}", *extra])
        results[name] = {"code": code, "table": stdout.getvalue(), "stderr": stderr.getvalue(),
                         "report": json.loads(report.read_text()) if report.exists() else None}
    (out / "cases.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main_(Path(sys.argv[1]), sys.argv[2:])
