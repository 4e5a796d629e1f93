"""One place that turns user-facing errors into a one-line message and a non-zero exit."""

from __future__ import annotations

import sys
from typing import Callable

from lib.checkpoint import CheckpointError
from lib.config import ConfigError
from lib.corpus import DataError
from lib.distributed import DistributedError
from lib.rollback import TrainingDiverged

USER_ERRORS = (ConfigError, DataError, CheckpointError, DistributedError, TrainingDiverged)


def run_cli(body: Callable[[], object]) -> int:
    """Run a recipe; a user error prints `error: ...` (one line) and exits with status 2."""
    try:
        body()
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
