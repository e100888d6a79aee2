import os
import sys

from loka_tune.cli import main

try:
    code: int | str | None = main()
except SystemExit as stop:
    code = stop.code
if os.environ.get("WORLD_SIZE", "1") != "1":  # a torchrun rank: end without finalization
    from loka_tune.objectives.distributed import exit_rank

    exit_rank(code)
sys.exit(code)
