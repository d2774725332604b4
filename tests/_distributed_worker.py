"""One rank of torchrun-launched test runs: `torchrun ... tests/_distributed_worker.py CONFIG.json... [STOP_AFTER_ON_RANK_1]`.

The configs train one after another in the same two processes, which spares a test that compares runs
a second interpreter start per rank. The first run joins torchrun's process group as `fp4lab train`
does; each later one is given a fresh group on its own prefix of torchrun's store (a group made again
on the same keys can meet the previous group's entries and hang). STOP_AFTER_ON_RANK_1 makes only
rank 1 ask to stop after that many steps of the last run, as a signal reaching one rank would: the
ranks must agree to stop together (fp4lab.train.loop._agreed_stop)."""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from fp4lab.train.config import TrainConfig
from fp4lab.train.loop import run

paths = [arg for arg in sys.argv[1:] if arg.endswith(".json")]
stop_args = [arg for arg in sys.argv[1:] if not arg.endswith(".json")]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
for index, path in enumerate(paths):
    config = TrainConfig.from_dict(json.loads(Path(path).read_text()))
    if index:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"fp4lab-test-run-{index}", store), rank=rank, world_size=world)
    last = index == len(paths) - 1
    stop_after = int(stop_args[0]) if stop_args and last and rank == 1 else None
    summary = run(config, progress=False, stop_after=stop_after)
    print(f"rank {rank} status {summary['status']} steps {summary['steps_completed']}", file=sys.stderr)
