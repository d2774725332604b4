"""One rank (or the one process) of a world-size-change test: `python tests/_resume_worker.py MODE CONFIG.json ...`,
under torchrun for parallel ddp/fsdp, as a plain process for parallel none.

    train CONFIG.json STOP_AFTER SAVED.pt   train, stopping after STOP_AFTER steps; every checkpoint the
                                            loop writes is also gathered whole (model and optimizer state
                                            as full tensors) into SAVED.pt, so a test sees what was saved
                                            without reading it back through DCP
    load CONFIG.json LOADED                 build the run and restore its folder's checkpoint as the loop
                                            does, then write LOADED-rank<r>.pt: the state gathered whole
                                            (rank 0), the step, and this rank's random streams
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from fp4lab.nn.build import attention_generators, fp4_linears
from fp4lab.nn.model_config import preset
from fp4lab.nn.recipe import load_recipe
from fp4lab.train import distributed, loop
from fp4lab.train.build import build_training, resolve_device
from fp4lab.train.checkpoint import resume_run
from fp4lab.train.config import TrainConfig
from fp4lab.train.data import load_dataset


def whole_state(model, optimizer) -> dict:
    """Model and optimizer state as full tensors, keyed by parameter name (a collective on ranks)."""
    model_state, optimizer_state = get_state_dict(
        model, list(optimizer.optimizers.values()), options=StateDictOptions(full_state_dict=True)
    )
    return {"model": {k: v for k, v in model_state.items() if not k.endswith("_extra_state")}, "optimizer": optimizer_state}


def streams(model) -> dict:
    return {
        "linears": {name: linear.get_extra_state() for name, linear in fp4_linears(model).items()},
        "attention_generators": [g.get_state() for g in attention_generators(model)],
    }


def train(config: TrainConfig, stop_after: int, saved: Path) -> None:
    save = loop.save_run

    def save_and_gather(out, config, model, optimizer, state, ranks) -> None:
        save(out, config, model, optimizer, state, ranks)
        whole = whole_state(model, optimizer)
        if ranks.main:
            torch.save(whole, saved)

    loop.save_run = save_and_gather
    loop.run(config, progress=False, stop_after=stop_after)


def load(config: TrainConfig, loaded: str) -> None:
    distributed.check(config, distributed.env_world())
    ranks, device = distributed.init(config, resolve_device(config.device))
    try:
        data = load_dataset(config.data, progress=False)
        model_config = preset(config.model, data.vocab_size, config.seq_len)
        model, optimizer, _ = build_training(config, load_recipe(config.recipe), model_config, device, ranks)
        state = resume_run(Path(config.out_dir), config, model, optimizer, ranks)
        result = {"step": state.step, "whole": whole_state(model, optimizer), "streams": streams(model)}
        torch.save(result, f"{loaded}-rank{ranks.rank}.pt")
    finally:
        distributed.close(ranks)


if __name__ == "__main__":
    mode, config_path, *rest = sys.argv[1:]
    run_config = TrainConfig.from_dict(json.loads(Path(config_path).read_text()))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if mode == "train":
        train(run_config, int(rest[0]), Path(rest[1]))
    else:
        load(run_config, rest[0])
