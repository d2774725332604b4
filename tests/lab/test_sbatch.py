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

ROOT = Path(__file__).resolve().parents[2]
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


EXTRA = """[slurm.extra]
        gres = "gpu:h100:1"
        mail_type = "END,FAIL"
        exclusive = true
        nice = 5
        comment = "two words # $(touch PWNED) `id`; 'q'"
        """


def test_extra_options_are_written_verbatim_and_quoted_only_where_needed(tmp_path):
    spec = load_spec(spec_file(tmp_path, "cpus_per_task = 1\n" + EXTRA))
    scripts = write_scripts(spec, expand(spec), tmp_path / "jobs", workdir=tmp_path, max_array_size=100)
    for script in (scripts[0], scripts[-1]):  # one run's script and the array's
        text = script.read_text()
        assert ('#SBATCH --gres=gpu:h100:1\n#SBATCH --mail-type=END,FAIL\n#SBATCH --exclusive\n#SBATCH --nice=5\n'
                '#SBATCH --comment="two words # $(touch PWNED) `id`; \'q\'"\n') in text
        head = text.split("\n\n")[0]  # sbatch reads #SBATCH lines up to the first command only
        assert head.index("--cpus-per-task=1") < head.index("--gres=") and "--exclusive" in head
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert not list(tmp_path.rglob("PWNED"))


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


# A fake srun: records argv (NUL-separated) and exits 1; with FAKE_SLEEP it waits for USR1, then
# writes the run's summary.json with FAKE_STATUS (none: a crash) and exits 1, as torchrun's agent does
# after passing a signal on to its ranks.
FAKE_SRUN = """#!/bin/bash
SLEEPER=
trap 'echo usr1 > "$FAKE_OUT.sig"
  if [ -n "${FAKE_STATUS:-}" ]; then mkdir -p "$FAKE_RUN"; echo "{\\"status\\": \\"$FAKE_STATUS\\"}" > "$FAKE_RUN/summary.json"; fi
  [ -n "$SLEEPER" ] && kill "$SLEEPER"; exit 1' USR1
printf '%s\\0' "$@" > "$FAKE_OUT"
if [ -n "${FAKE_SLEEP:-}" ]; then
  sleep 20 >/dev/null 2>&1 &
  SLEEPER=$!
  wait
fi
exit 1
"""


def fake_slurm(folder: Path) -> dict[str, str]:
    """srun (FAKE_SRUN) and scontrol (`show hostnames`: node1, node2; `requeue`: noted) on PATH, and a
    job 20123 of two nodes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "srun").write_text(FAKE_SRUN)
    (folder / "scontrol").write_text(f'#!/bin/sh\nif [ "$1" = show ]; then printf "node1\\nnode2\\n"; '
                                     f'else echo "$@" >> {folder}/scontrol.args; fi\n')
    for name in ("srun", "scontrol"):
        (folder / name).chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}", "SLURM_JOB_ID": "20123", "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "node[1-2]"}


RANKS = "gpus_per_node = 4\nnodes = 2\ncpus_per_task = 3\ntime = 30"
RANKS_AXES = "lr = [0.01, 0.02]"


def ranks_spec(tmp_path: Path, extra: str = RANKS, base: str = 'parallel = "fsdp"\nbatch_size = 16') -> Path:
    path = spec_file(tmp_path, extra, RANKS_AXES)
    path.write_text(path.read_text().replace("[base]\n", f"[base]\n{base}\n"))
    return path


def test_runs_of_several_ranks_start_srun_torchrun_with_a_rendezvous_on_the_first_node(tmp_path):
    """srun starts one torchrun agent per node with every rank's CPUs and the node's GPUs; the agents
    meet on the first node at a port from the job id; hostile paths reach srun verbatim."""
    spec = load_spec(ranks_spec(tmp_path))
    assert (spec.slurm.ranks_per_node, spec.slurm.ranks) == (4, 8)
    runs = expand(spec)
    workdir = tmp_path / ("work " + HOSTILE)
    workdir.mkdir()
    python = tmp_path / HOSTILE / "py thon"
    scripts = write_scripts(spec, runs, tmp_path / "jobs", python=python, workdir=workdir, max_array_size=100,
                            catalog=tmp_path / "cat $x.json")
    env = fake_slurm(tmp_path / "bin")
    out = tmp_path / "argv"
    for script, task in ((scripts[0], None), (scripts[-1], "1")):
        text = script.read_text()
        assert "#SBATCH --ntasks-per-node=4" in text and "#SBATCH --gpus-per-node=4" in text
        assert "single-process" not in text
        assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
        proc = subprocess.run(["bash", str(script)], env={**os.environ, **env, "FAKE_OUT": str(out),
                              **({"SLURM_ARRAY_TASK_ID": task} if task else {})}, capture_output=True, text=True, timeout=30,
                              check=False)
        assert proc.returncode == 1, proc.stderr  # the fake agent's exit status, no requeue
        run = runs[int(task or 0)]
        assert argv(out) == [
            "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=12", "--gpus-per-node=4",
            "--kill-on-bad-exit=1", str(python), "-u", "-m", "torch.distributed.run", "--nnodes=2",
            "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node1:10123", "--rdzv-id=20123",
            "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=120",
            "-m", "fp4lab.cli", "train", "--config", str(tmp_path / "jobs" / "t" / f"{run.id}.toml"),
            "--catalog", str(tmp_path / "cat $x.json")]
    assert not (tmp_path / "bin" / "scontrol.args").exists()
    assert not list(tmp_path.rglob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))
    # CPU ranks: ntasks_per_node of them per node, one CPU each unless cpus_per_task says more
    spec = load_spec(ranks_spec(tmp_path, "ntasks_per_node = 2", 'parallel = "ddp"\nbatch_size = 4'))
    text = write_scripts(spec, expand(spec), tmp_path / "jobs2", workdir=tmp_path)[0].read_text()
    assert "--cpus-per-task=2 --kill-on-bad-exit=1" in text and "--nproc-per-node=2 " in text and "gpus" not in text


@pytest.mark.parametrize("status, requeued", [("preempted", True), ("completed", False), ("", False), ("stale", False)])
def test_several_ranks_requeue_only_when_this_attempt_checkpointed(tmp_path, status, requeued):
    """After USR1 torchrun's agent exits 1 however cleanly the ranks stopped: the job is requeued when
    rank 0's summary.json, written during this attempt, says "preempted"; not after a crash (no
    summary, or one left by an earlier attempt) nor when the run completed."""
    spec = load_spec(ranks_spec(tmp_path))
    runs = expand(spec)
    scripts = write_scripts(spec, runs, tmp_path / "jobs", workdir=tmp_path, max_array_size=100)
    run_dir = tmp_path / runs[0].config["out_dir"]
    if status == "stale":
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text('{"status": "preempted"}')
        os.utime(run_dir / "summary.json", (time.time() - 60, time.time() - 60))
    env = {**os.environ, **fake_slurm(tmp_path / "bin"), "FAKE_OUT": str(tmp_path / "argv"), "FAKE_RUN": str(run_dir),
           "FAKE_SLEEP": "1", "FAKE_STATUS": "" if status == "stale" else status}
    proc = subprocess.Popen(["bash", str(scripts[0])], env=env, stdout=subprocess.PIPE, text=True)
    while proc.poll() is None and not (tmp_path / "argv.sig").exists():  # as in the USR1 test above
        if (tmp_path / "argv").exists():
            proc.send_signal(signal.SIGUSR1)
        time.sleep(0.02)
    stdout, _ = proc.communicate(timeout=30)
    assert (tmp_path / "argv.sig").exists()
    notes = tmp_path / "bin" / "scontrol.args"
    if requeued:
        assert proc.returncode == 0 and notes.read_text() == "requeue 20123\n" and "requeueing job 20123" in stdout
    else:
        assert proc.returncode == 1 and not notes.exists()


@pytest.mark.parametrize("extra, base, where, fragment", [
    (RANKS, 'batch_size = 16', "base.parallel", 'parallel = "none" trains in one process, but [slurm] gpus_per_node = 4 on nodes = 2 gives each run 8 ranks'),
    ("ntasks_per_node = 2", 'parallel = "ddp"\nbatch_size = 5', "base.batch_size", "batch_size = 5 does not split over the 2 ranks"),
    ("nodes = 3", 'parallel = "ddp"\nbatch_size = 4', "base.batch_size", "use a multiple of 3"),
    ("gpus_per_node = 2\nntasks_per_node = 4", 'parallel = "ddp"', "slurm.ntasks_per_node", "one rank per GPU"),
])
def test_specs_whose_ranks_could_not_share_a_run_are_refused(tmp_path, extra, base, where, fragment):
    with pytest.raises(SpecError) as error:
        load_spec(ranks_spec(tmp_path, extra, base))
    assert f"{where}: " in str(error.value) and fragment in str(error.value) and "\n" not in str(error.value)


def test_rank_checks_follow_the_axis_that_sets_the_value(tmp_path):
    path = ranks_spec(tmp_path, "ntasks_per_node = 2", "batch_size = 4")
    path.write_text(path.read_text().replace(RANKS_AXES, "parallel = ['ddp', 'fsdp']"))
    assert [r.config["parallel"] for r in expand(load_spec(path))] == ["ddp", "fsdp"]  # base's none is never used
    path.write_text(path.read_text().replace("parallel = ['ddp', 'fsdp']", "parallel = ['ddp', 'none']"))
    with pytest.raises(SpecError, match=r"axes\.parallel\[1\]: parallel = \"none\""):
        load_spec(path)
    optuna = ranks_spec(tmp_path, "ntasks_per_node = 2", 'parallel = "ddp"\nbatch_size = 4')
    optuna.write_text(optuna.read_text().replace("[axes]\n" + RANKS_AXES, 'method = "optuna"')
                      .replace('description = "test sweep"', 'description = "test sweep"\nmethod = "optuna"')
                      .replace('method = "optuna"\n[slurm]', '[optuna]\nn_trials = 2\nsearch_space = { lr = { type = "float", low = 0.01, high = 0.02 } }\n[slurm]'))
    with pytest.raises(SpecError, match=r"slurm: .*method = \"optuna\" trains each trial in one process"):
        load_spec(optuna)


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
