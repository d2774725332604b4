"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases and MLflow (config `log_to`).

    log = open_run_log(config, identity, out, resume_step)   # rank 0: metrics.jsonl + the trackers
    log.write(record)                                        # each metrics record, as the loop makes it
    log.close(summary)                                       # at the end (or {"status": "failed"})

One interface, `MetricsWriter` (write, close), which MetricsLog (metrics.jsonl) and each tracker keep;
`RunLog` hands every record to all of them. What a tracker gets:
- each record's scalars (`scalars`): loss, lr, grad_norm, tokens_per_s, val_loss, qk_clipped_heads,
  max_logit_max, per layer `attention/entropy/layer_<i>` and `attention/max_logit/layer_<i>`, per FP4
  operand `quant/<layer>/<operand>/saturated` and `.../flushed`;
- the resolved run (config.json's content) once, as its config or parameters;
- the summary's scalars and status at the end.

How each files a run: group = config.tracker_group (a sweep sets its name), name = config.tracker_run
(a sweep sets the run id; else the run folder's name).
- TensorBoard: event files in the run folder, so `tensorboard --logdir runs/<sweep>` shows the sweep's
  runs by id. A resumed run writes a new event file with purge_step = the resumed step: TensorBoard
  drops the older file's steps from there on, so the curve is the run's one.
- W&B: project $WANDB_PROJECT (else "fp4lab"), files under <run folder>/wandb/. Offline unless the
  user has logged in ($WANDB_API_KEY or `wandb login`'s ~/.netrc entry) or set $WANDB_MODE. A run
  keeps one W&B run id (trackers.json); online a resumed run continues it (resume="allow"); offline
  W&B cannot resume, so each segment is an offline folder of its own under that same id.
- MLflow: $MLFLOW_TRACKING_URI, else MLflow's default store (sqlite `mlflow.db` in the folder the
  run starts in); experiment = the group (else "fp4lab"). The store and run id are kept in
  trackers.json: a resumed run reopens that run. Steps logged after the last checkpoint of a killed
  run are logged again when it resumes (resuming is exact, so with the same values).

A tracker that fails while the run trains (a full disk, a server down) is reported once on stderr and
left out from then on; training and metrics.jsonl go on. A tracker whose package is missing is an
error before training starts (`missing_packages`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import netrc
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from fp4lab.train.atomic import write_atomic
from fp4lab.train.config import TRACKERS, ConfigError, TrainConfig

STATE_FILE = "trackers.json"  # in the run folder: the W&B and MLflow run ids, to continue them
DEFAULT_GROUP = "fp4lab"
PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
MLFLOW_STATUS = {"completed": "FINISHED", "diverged": "FINISHED", "failed": "FAILED"}  # else (stopped) KILLED


class MetricsWriter(Protocol):
    """Where a run's metrics records go: metrics.jsonl (train.checkpoint.MetricsLog) and each tracker."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self, summary: dict[str, Any] | None = None) -> None: ...


def missing_packages(log_to: list[str]) -> list[str]:
    """The trackers of `log_to` whose library is not installed."""
    return [name for name in log_to if importlib.util.find_spec(PACKAGE[name]) is None]


def check_installed(log_to: list[str]) -> None:
    missing = missing_packages(log_to)
    if missing:
        raise ConfigError(f"log_to={log_to!r}: {', '.join(missing)} not installed; pip install 'fp4lab[trackers]' "
                          "(or leave them out of log_to)")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite scalars of one metrics record, by tracker name (the module's docstring lists them)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if key == "attn_entropy_mean":
            out.update({f"attention/entropy/layer_{i}": v for i, v in enumerate(value)})
        elif key == "max_logit":
            out.update({f"attention/max_logit/layer_{i}": max(heads) for i, heads in enumerate(value) if heads})
        elif key == "quant":
            for layer, operands in value.items():
                for operand, (saturated, flushed) in operands.items():
                    out[f"quant/{layer}/{operand}/saturated"] = saturated
                    out[f"quant/{layer}/{operand}/flushed"] = flushed
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    return {key: float(value) for key, value in out.items() if math.isfinite(value)}


def flat_config(identity: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """config.json's nested tables as dotted keys (`config.lr`, `model.n_layers`), for trackers that
    take flat parameters; lists become JSON text."""
    flat: dict[str, Any] = {}
    for key, value in identity.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, tuple)) else value
    return flat


class RunLog:
    """metrics.jsonl and the trackers as one MetricsWriter. A tracker that raises is reported once and
    dropped; the jsonl log is never dropped."""

    def __init__(self, jsonl: MetricsWriter, trackers: dict[str, MetricsWriter]) -> None:
        self.jsonl, self.trackers = jsonl, dict(trackers)

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        for name in list(self.trackers):
            self._call(name, "write", record)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self.jsonl.close(summary)
        for name in list(self.trackers):
            self._call(name, "close", summary)

    def _call(self, name: str, method: str, argument: dict[str, Any] | None) -> None:
        try:
            getattr(self.trackers[name], method)(argument)
        except Exception as exc:  # a tracker is never worth a run: any failure of its library
            self.trackers.pop(name)
            print(f"fp4lab: warning: tracker {name} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                  "the run goes on without it, and metrics.jsonl keeps every metric", file=sys.stderr, flush=True)


def open_run_log(config: TrainConfig, identity: dict[str, Any], out: Path, resume_step: int, jsonl: MetricsWriter) -> RunLog:
    """`jsonl` and the trackers of config.log_to, each opened for this segment of the run (a tracker
    that cannot open is reported and left out, as one failing later)."""
    state = _read_state(out)
    log = RunLog(jsonl, {})
    name = config.tracker_run or Path(out).resolve().name
    group = config.tracker_group
    for tracker in config.log_to:
        opener = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}[tracker]
        try:
            log.trackers[tracker] = opener(out, group, name, identity, resume_step, state)
        except Exception as exc:
            print(f"fp4lab: warning: tracker {tracker} could not start ({type(exc).__name__}: {exc}); "
                  "the run goes on without it, and metrics.jsonl keeps every metric", file=sys.stderr, flush=True)
    if state:
        write_atomic(Path(out) / STATE_FILE, json.dumps(state, indent=1) + "\n")
    return log


def _read_state(out: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(out) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _summary_scalars(summary: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in summary.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


class TensorBoard:
    def __init__(self, out: Path, group: str | None, name: str, identity: dict[str, Any], resume_step: int, state: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out), purge_step=resume_step or None)
        if not resume_step:
            self.writer.add_text("config", "```\n" + json.dumps(identity, indent=1, default=str) + "\n```", 0)

    def write(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary:
            self.writer.add_text("summary", "```\n" + json.dumps(summary, indent=1, default=str) + "\n```",
                                 summary.get("steps_completed", 0))
        self.writer.close()


def wandb_mode() -> str:
    """$WANDB_MODE when set; else "online" for a user who has logged in, "offline" otherwise."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


class WandB:
    def __init__(self, out: Path, group: str | None, name: str, identity: dict[str, Any], resume_step: int, state: dict) -> None:
        import wandb

        run_id = state.setdefault("wandb", {}).setdefault("id", secrets.token_hex(4))
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_GROUP, group=group, name=name, id=run_id, resume="allow",
            dir=str(out), config=identity, mode=wandb_mode(),
            settings=wandb.Settings(console="off", silent=True),
        )

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary:
            self.run.summary.update({f"summary/{k}": v for k, v in _summary_scalars(summary).items()}
                                    | {"summary/status": summary.get("status")})
        self.run.finish(exit_code=1 if (summary or {}).get("status") == "failed" else 0)
        import wandb

        wandb.teardown()  # stops W&B's service and takes $WANDB_SERVICE back: processes started later must not look for it


class MLflow:
    def __init__(self, out: Path, group: str | None, name: str, identity: dict[str, Any], resume_step: int, state: dict) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its store's migrations, said at every first start
        kept = state.get("mlflow", {})
        uri = kept.get("tracking_uri") or _mlflow_uri()
        self.client = MlflowClient(uri)
        if kept.get("run_id"):
            self.run_id = kept["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self._experiment(group or DEFAULT_GROUP)
            self.run_id = self.client.create_run(experiment, run_name=name, tags={"fp4lab.run_folder": str(Path(out).resolve())}).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in flat_config(identity).items()]
            for start in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[start:start + 100])
            state["mlflow"] = {"tracking_uri": uri, "run_id": self.run_id}

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # another run of the sweep created it first
            return self.client.get_experiment_by_name(name).experiment_id

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, record["step"]) for key, value in scalars(record).items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self, summary: dict[str, Any] | None = None) -> None:
        from mlflow.entities import Metric, RunTag

        status = (summary or {}).get("status", "failed")
        if summary:
            now = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[Metric(f"summary/{k}", v, now, 0) for k, v in _summary_scalars(summary).items()],
                                  tags=[RunTag("fp4lab.status", str(status))])
        self.client.set_terminated(self.run_id, status=MLFLOW_STATUS.get(status, "KILLED"))


def _mlflow_uri() -> str:
    """The store MLflow would use here ($MLFLOW_TRACKING_URI, else its default), as an absolute URI,
    so that a run resumed from another folder reopens the same store."""
    import mlflow

    return mlflow.get_tracking_uri()


__all__ = ["TRACKERS", "MetricsWriter", "RunLog", "check_installed", "missing_packages", "open_run_log", "scalars"]
