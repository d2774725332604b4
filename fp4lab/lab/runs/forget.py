"""Forgetting a sweep (`fp4lab forget`): its rows leave the catalog; a run another sweep shares stays,
without this sweep's name. Run folders stay unless asked. A sweep with a run in flight is refused
whole: its trainer would record into a row that is gone."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4lab.lab.records.catalog import IN_FLIGHT_STATES, Catalog, live_owner, sweeps_of
from fp4lab.train import run_folder


class SweepInFlight(ValueError):
    """A run of the sweep is being trained or is queued on Slurm."""


@dataclass(frozen=True)
class Forgetting:
    """What forgetting a sweep does: the rows it removes and the shared rows it only takes its name off."""

    sweep: str
    removed: list[dict[str, Any]]
    shared: list[dict[str, Any]]

    def run_dirs(self, catalog: Catalog) -> list[Path]:
        """The removed rows' run folders that exist."""
        found = (catalog.resolve(r["paths"].get("run_dir")) for r in self.removed)
        return [folder for folder in found if folder is not None and folder.is_dir()]


def plan_forget(catalog: Catalog, sweep: str) -> Forgetting:
    """What `forget` would do; ValueError for a sweep the catalog does not hold, SweepInFlight for one
    with a run in flight."""
    members = [record for r in catalog.records(sweep=sweep) if (record := catalog.get(r["id"])) is not None]
    if not members:
        known = catalog.sweeps()
        raise ValueError(f"{catalog.path}: no sweep {sweep!r} (sweeps: {', '.join(known) or 'none'})")
    busy = [r for r in members if _in_flight(catalog, r)]
    if busy:
        raise SweepInFlight(f"sweep {sweep!r} has {len(busy)} run(s) in flight (e.g. {busy[0]['id']}, {busy[0]['state']}): "
                            "wait for them or stop them first (fp4lab status)")
    removed = [r for r in members if sweeps_of(r) == [sweep]]
    shared = [r for r in members if sweeps_of(r) != [sweep]]
    return Forgetting(sweep, removed, shared)


def forget(catalog: Catalog, forgetting: Forgetting, *, delete_runs: bool = False) -> list[Path]:
    """Apply `forgetting` in one catalog transaction (checked again inside it); with `delete_runs`, then
    delete the removed rows' run folders. Returns the folders deleted."""
    folders = forgetting.run_dirs(catalog) if delete_runs else []
    with catalog.transaction() as tx:
        for record in forgetting.removed + forgetting.shared:
            current = tx.get(record["id"])
            if current is None or forgetting.sweep not in sweeps_of(current):
                continue
            if _in_flight(catalog, current):
                raise SweepInFlight(f"run {current['id']} of sweep {forgetting.sweep!r} started meanwhile; nothing was forgotten")
            remaining = [name for name in sweeps_of(current) if name != forgetting.sweep]
            if remaining:
                tx.update(current["id"], sweep=remaining[0], sweeps=remaining)
            else:
                tx.delete(current["id"])
    for folder in folders:
        if run_folder.holder(folder) is None:
            shutil.rmtree(folder)
    return [folder for folder in folders if not folder.exists()]


def _in_flight(catalog: Catalog, record: dict[str, Any]) -> bool:
    run_dir = catalog.resolve(record["paths"].get("run_dir"))
    if run_dir is not None and run_folder.holder(run_dir) is not None:
        return True
    return record["state"] in IN_FLIGHT_STATES and bool(live_owner(record) or record.get("slurm_job_id"))
