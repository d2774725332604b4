"""SBATCH writer: files on disk, array splitting, bash syntax, values that reach the trainer
verbatim through hostile paths, signal forwarding and requeue, nothing written on error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from fp4lab.lab.runs.sbatch import write_scripts
from fp4lab.lab.runs.slurm import max_array_size as slurm_max_array_size
from fp4lab.lab.specs.sweep_spec import SpecError, expand, load_spec

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = "we ird $(touch PWNED) `touch PWNED2`; 'q\" \\ *"

# A fake interpreter: records argv (NUL-separated) and cwd; with FAKE_SLEEP waits for USR1.
FAKE_PYTHON = """#!/bin/bash
SLEEPER=
trap 'echo usr1 > "$FAKE_OUT.sig"; [ -n "$SLEEPER" ] && kill "$SLEEPER"; exit 0' USR1
printf '%s\\0' "$@" > "$FAKE_OUT"
pwd >> "$FAKE_OUT.cwd"
if [ -n "${FAKE_SLEEP:-}" ]; then
  sleep 20 >/dev/null 2>&1 &
  SLEEPER=$!
  wait
fi
exit "${FAKE_RC:-0}"
"""


def make_fake(folder: Path, name: str = "python") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return path


def spec_file(tmp_path: Path, extra: str = "", axes: str = "recipe = ['bf16', 'nvfp4']") -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(textwrap.dedent(f"""
        name = "t"
        description = "test sweep"
        [base]
        model = "tiny"
        steps = 10
        [base.data]
        source = "synthetic"
        [axes]
        {axes}
        [slurm]
        {extra}
        """))
    return path


def run_script(script: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], env={**os.environ, "FAKE_OUT": str(out), **env},
                          capture_output=True, text=True, timeout=20)


def argv(out: Path) -> list[str]:
    return out.read_bytes().decode().split("\0")[:-1]


@pytest.mark.parametrize("name", ["quickstart", "recipes", "muon_qkclip"])
def test_shipped_sweeps_write_valid_scripts(tmp_path, name):
    spec = load_spec(ROOT / "sweeps" / f"{name}.toml")
    runs = expand(spec)
    scripts = write_scripts(spec, runs, tmp_path / "jobs", workdir=ROOT, max_array_size=1001)
    folder = tmp_path / "jobs" / name
    assert scripts[: len(runs)] == [folder / f"{r.id}.sbatch" for r in runs]
    assert scripts[len(runs):] == [folder / "array_0.sbatch"]
    assert (folder / "logs").is_dir()
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
        assert os.access(script, os.X_OK)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [r["id"] for r in manifest["runs"]] == [r.id for r in runs]
    assert not list(folder.glob(".*.tmp"))


def test_configs_round_trip_through_train_config(tmp_path):
    from fp4lab.train.config import TrainConfig

    spec = load_spec(ROOT / "sweeps" / "muon_qkclip.toml")
    runs = expand(spec)
    write_scripts(spec, runs, tmp_path, workdir=tmp_path, max_array_size=1001)
    for run in runs[:5]:
        assert TrainConfig.from_toml(tmp_path / "muon_qkclip" / f"{run.id}.toml").to_dict() == run.config


def test_sbatch_lines_cover_every_slurm_field(tmp_path):
    extra = """partition = "gpu"
        account = "proj"
        qos = "high"
        gpus_per_node = 1
        ntasks_per_node = 1
        cpus_per_task = 8
        mem = "64G"
        time = "04:00:00"
        constraint = "h100&ib"
        exclude = "node[01-04]"
        array_parallelism = 3
        signal_before_timeout_s = 200
        setup = ["module load cuda", "export X=1"]"""
    spec = load_spec(spec_file(tmp_path, extra))
    scripts = write_scripts(spec, expand(spec), tmp_path / "jobs", workdir=tmp_path, max_array_size=100)
    text = scripts[0].read_text()
    for line in ["--partition=gpu", "--account=proj", "--qos=high", "--gpus-per-node=1", "--ntasks-per-node=1",
                 "--cpus-per-task=8", "--mem=64G", "--time=04:00:00", "--constraint=h100&ib",
                 "--exclude=node[01-04]", "--signal=B:USR1@200", "--requeue", "--nodes=1"]:
        assert f"#SBATCH {line}\n" in text
    assert f"#SBATCH --output={tmp_path}/jobs/t/logs/" in text and "module load cuda\nexport X=1\n" in text
    assert "#SBATCH --array=0-1%3\n" in scripts[-1].read_text()
    assert "fp4lab.cli train --config" in text


def test_arrays_split_at_max_array_size(tmp_path):
    spec = load_spec(ROOT / "sweeps" / "muon_qkclip.toml")
    runs = expand(spec)
    scripts = write_scripts(spec, runs, tmp_path, workdir=tmp_path, max_array_size=10)
    arrays = [s for s in scripts if s.name.startswith("array_")]
    assert [s.name for s in arrays] == [f"array_{k}.sbatch" for k in range(4)]
    ids = []
    for k, script in enumerate(arrays):
        listed = (tmp_path / "muon_qkclip" / f"array_{k}.runs").read_text().split()
        assert len(listed) == (10 if k < 3 else 6)
        assert f"#SBATCH --array=0-{len(listed) - 1}%12\n" in script.read_text()
        ids += listed
    assert ids == [r.id for r in runs]


def test_array_size_from_spec_and_scontrol(tmp_path, monkeypatch):
    spec = load_spec(spec_file(tmp_path, "max_array_size = 1", "lr = [0.01, 0.02, 0.03]"))
    scripts = write_scripts(spec, expand(spec), tmp_path / "jobs", workdir=tmp_path)
    assert len([s for s in scripts if s.name.startswith("array_")]) == 3
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'Configuration data'\necho 'MaxArraySize            = 40001'\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert slurm_max_array_size() == 40001
    (bin_dir / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    assert slurm_max_array_size() == 1001
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert slurm_max_array_size() == 1001


def test_hostile_paths_and_values_arrive_verbatim(tmp_path):
    """The interpreter path, the working directory and string config values with spaces, quotes,
    $(...), backticks, semicolons and newlines: bash -n passes, nothing is executed, argv is exact."""
    fake = make_fake(tmp_path / HOSTILE / "bin", "py thon")
    workdir = tmp_path / ("work " + HOSTILE)
    workdir.mkdir()
    hostile_value = HOSTILE + "\nsecond line\r\x7f"
    axes = f"'data.source' = [\"synthetic\", {json.dumps(hostile_value)}]"
    spec = load_spec(spec_file(tmp_path, "setup = [\"echo setup-ran > marker.txt\"]", axes))
    runs = expand(spec)
    scripts = write_scripts(spec, runs, tmp_path / "jobs", python=fake, workdir=workdir, max_array_size=100)
    out = tmp_path / "argv"
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
        for line in script.read_text().splitlines():  # one logical line per line, comments stay comments
            assert line.isprintable()
    from fp4lab.train.config import TrainConfig

    config = TrainConfig.from_toml(tmp_path / "jobs" / "t" / f"{runs[1].id}.toml")
    assert config.data.source == hostile_value

    for i, run in enumerate(runs):
        result = run_script(scripts[i], out)
        assert result.returncode == 0, result.stderr
        assert argv(out) == ["-u", "-m", "fp4lab.cli", "train", "--config", str(tmp_path / "jobs" / "t" / f"{run.id}.toml")]
        result = run_script(scripts[-1], out, SLURM_ARRAY_TASK_ID=str(i))
        assert result.returncode == 0, result.stderr
        assert argv(out)[-1] == str(tmp_path / "jobs" / "t" / f"{run.id}.toml")
    assert (out.parent / "argv.cwd").read_text().splitlines() == [str(workdir)] * 4
    assert (workdir / "marker.txt").read_text() == "setup-ran\n"
    assert not list(tmp_path.rglob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))


def test_exit_status_and_bad_array_task(tmp_path):
    fake = make_fake(tmp_path / "bin")
    spec = load_spec(spec_file(tmp_path))
    scripts = write_scripts(spec, expand(spec), tmp_path / "jobs", python=fake, workdir=tmp_path, max_array_size=100)
    out = tmp_path / "argv"
    assert run_script(scripts[0], out, FAKE_RC="3").returncode == 3
    bad = run_script(scripts[-1], out, SLURM_ARRAY_TASK_ID="7")
    assert bad.returncode == 1 and "no run id on line 8" in bad.stderr
    assert run_script(scripts[-1], out).returncode != 0  # not an array task


def test_usr1_is_forwarded_and_the_job_requeued(tmp_path):
    fake = make_fake(tmp_path / "bin")
    (tmp_path / "bin" / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/scontrol.args\n")
    (tmp_path / "bin" / "scontrol").chmod(0o755)
    spec = load_spec(spec_file(tmp_path))
    scripts = write_scripts(spec, expand(spec), tmp_path / "jobs", python=fake, workdir=tmp_path, max_array_size=100)
    out = tmp_path / "argv"
    env = {**os.environ, "FAKE_OUT": str(out), "FAKE_SLEEP": "1", "SLURM_JOB_ID": "123",
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    proc = subprocess.Popen(["bash", str(scripts[0])], env=env, stdout=subprocess.PIPE, text=True)
    # The fake trainer writes FAKE_OUT once its USR1 trap is set, and the batch shell has set its traps
    # before starting it. The shell forwards USR1 only once it holds the trainer's pid ($CHILD), which it
    # may not yet when FAKE_OUT appears (a USR1 before that only marks the requeue), so USR1 is sent
    # until the trainer has had one; the loop ends with the script at the latest (FAKE_SLEEP: 20 s).
    while proc.poll() is None and not (tmp_path / "argv.sig").exists():
        if out.exists():
            proc.send_signal(signal.SIGUSR1)
        time.sleep(0.02)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert (tmp_path / "argv.sig").read_text() == "usr1\n"
    assert (tmp_path / "scontrol.args").read_text() == "requeue 123\n"
    assert "requeueing job 123" in stdout


def test_multi_gpu_templates(tmp_path):
    for extra, expected in [("gpus_per_node = 4", "torch.distributed.run --standalone --nproc-per-node=4"),
                            ("gpus_per_node = 8\nnodes = 2", "srun --ntasks-per-node=1")]:
        spec = load_spec(spec_file(tmp_path, extra))
        scripts = write_scripts(spec, expand(spec), tmp_path / "jobs", workdir=tmp_path, max_array_size=100)
        text = scripts[0].read_text()
        assert expected in text and "single-process today" in text
        assert subprocess.run(["bash", "-n", str(scripts[0])]).returncode == 0


def test_nothing_written_on_error(tmp_path):
    spec = load_spec(spec_file(tmp_path))
    jobs = tmp_path / "bad jobs"
    with pytest.raises(SpecError, match="#SBATCH"):
        write_scripts(spec, expand(spec), jobs, workdir=tmp_path)
    assert not jobs.exists()
    jobs = tmp_path / "jobs%x"
    with pytest.raises(SpecError):
        write_scripts(spec, expand(spec), jobs, workdir=tmp_path)
    assert not jobs.exists()
