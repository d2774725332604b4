"""One rank of a torchrun-launched test run: `torchrun ... tests/_distributed_worker.py CONFIG.json [STOP_AFTER_ON_RANK_1]`.

STOP_AFTER_ON_RANK_1 makes only rank 1 ask to stop after that many steps, as a signal reaching one
rank would: the ranks must agree to stop together (fp4lab.train.loop._agreed_stop)."""

import json
import os
import sys
from pathlib import Path

from fp4lab.train.config import TrainConfig
from fp4lab.train.loop import run

config = TrainConfig.from_dict(json.loads(Path(sys.argv[1]).read_text()))
stop_after = int(sys.argv[2]) if len(sys.argv) > 2 and os.environ["RANK"] == "1" else None
summary = run(config, progress=False, stop_after=stop_after)
print(f"rank {os.environ['RANK']} status {summary['status']} steps {summary['steps_completed']}", file=sys.stderr)
