"""``paratrain train`` under Slurm (docs/slurm.md): srun's environment read as a world (pure
logic), then jobs of scripts/slurm/train.sbatch on a real one-node Slurm started here
(scripts/slurm/local_cluster.py: munged, slurmctld and slurmd from Debian's packages): a
2-task job equals the same run without Slurm; a job preempted (Slurm's own requeue, or the
SIGTERM of ``--signal``) is requeued and resumes to the uninterrupted run's exact final
checkpoint; a cancelled job leaves no partial checkpoint and stays cancelled."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from helpers import LONG_RUN as RUN, LONG_STEPS as STEPS, final_files as _final_files

from paratrain.slurm import first_host, rendezvous_port, slurm_world, started_by_srun, tasks_on_node
from paratrain.train.config import ConfigError
from paratrain.train.saved import published

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"
sys.path.insert(0, str(ROOT / "scripts" / "slurm"))
import local_cluster  # noqa: E402  (a script beside the batch script, reusable by hand)

TASK = {  # what srun set for task 1 of a 2-task step (measured on the local cluster)
    "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NTASKS": "2", "SLURM_CLUSTER_NAME": "paratrain",
}


# -- srun's environment ------------------------------------------------------------------

def test_only_an_srun_step_of_several_tasks_is_a_slurm_world():
    assert started_by_srun(TASK)
    batch = {k: v for k, v in TASK.items() if not k.startswith("SLURM_STEP")}  # the batch script
    assert not started_by_srun(batch)
    assert not started_by_srun({**TASK, "SLURM_STEP_NUM_TASKS": "1"})  # srun -n1: paratrain launches
    assert not started_by_srun({})


def test_the_world_is_read_from_srun_variables():
    world = slurm_world({**TASK, "SLURM_RESTART_COUNT": "2"}, backend="gloo")
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == (1, 2, 1, 2)
    assert world.store_at == ("vm", rendezvous_port(7, 0), False)  # rank 0 hosts the store
    assert (world.attempt, world.job) == (2, "slurm-paratrain-7")
    other = slurm_world({**TASK, "SLURM_PROCID": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
                         "SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "2(x2),3",
                         "SLURM_STEP_NODELIST": "gpu[07-09]"}, backend="gloo")
    assert (other.rank, other.local_rank, other.local_world_size, other.store_at[0]) == (5, 0, 3, "gpu07")
    given = slurm_world({**TASK, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}, backend="gloo")
    assert given.store_at == ("10.0.0.1", 29400, False)
    assert rendezvous_port(7, 0) != rendezvous_port(7, 1) and 15000 <= rendezvous_port(10**9, 3) < 32000


def test_host_lists_and_tasks_per_node():
    assert [first_host(x) for x in ("vm", "gpu[07-09,12],cpu1", "n1,n2", "a[3]", "x[1-2]-ib,y")] == \
        ["vm", "gpu07", "n1", "a3", "x1-ib"]
    assert [tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]


@pytest.mark.parametrize("change, named", [
    ({"SLURM_PROCID": None}, "SLURM_PROCID"),
    ({"SLURM_STEP_NODELIST": None}, "SLURM_STEP_NODELIST"),
    ({"SLURM_LOCALID": "one"}, "SLURM_LOCALID='one'"),
    ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2"),
    ({"SLURM_STEP_NODELIST": "gpu[07"}, "SLURM_STEP_NODELIST"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(3)"}, "SLURM_STEP_TASKS_PER_NODE"),
    ({"SLURM_NODEID": "1"}, "SLURM_NODEID=1"),
    ({"MASTER_PORT": "x"}, "MASTER_PORT"),
])
def test_a_bad_slurm_environment_is_refused_naming_the_variable(change, named):
    env = {k: v for k, v in {**TASK, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("(", r"\(")):
        slurm_world(env)


# -- jobs on a real Slurm ----------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        cluster = local_cluster.Cluster(tmp_path_factory.mktemp("slurm")).start()
    except local_cluster.Unavailable as exc:
        pytest.skip(f"no local Slurm cluster: {exc}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def whole(uninterrupted) -> dict:
    """The final checkpoint's files of the run without Slurm (paratrain's own launcher;
    conftest's, shared with test_preempt)."""
    return uninterrupted


def _submit(cluster, tmp_path: Path, *extra: str) -> tuple[str, Path, Path]:
    run, out = tmp_path / "run", tmp_path / "job.out"
    job = cluster.submit("--chdir", str(tmp_path), "--output", str(out), str(SCRIPT), *RUN, *extra,
                         env={"RUN_DIR": str(run), "PARATRAIN": f"{sys.executable} -m paratrain",
                              "TMPDIR": str(tmp_path)})
    return job, run, out


def _wait_for_steps(cluster, job: str, metrics: Path, steps: int, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        if done >= steps:
            return done
        assert cluster.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), cluster.job(job)
        time.sleep(0.1)
    raise AssertionError(f"job {job}: no {steps} steps in {metrics} within {timeout_s} s")


def _log(out: Path) -> str:
    return out.read_text()[-3000:] if out.exists() else "(no job output)"


def test_a_two_task_job_equals_the_run_without_slurm(cluster, whole, tmp_path):
    job, run, out = _submit(cluster, tmp_path)
    try:
        fields = cluster.wait(job, timeout_s=180)
    finally:
        cluster.run("scancel", job, check=False)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), _log(out)
    assert "dp2 (world 2)" in out.read_text(), _log(out)  # the two srun tasks were one world
    assert _final_files(run) == whole  # bit for bit


@pytest.mark.parametrize("how", [pytest.param("scontrol-requeue", marks=pytest.mark.slow), "signal-term"])
def test_a_preempted_job_is_requeued_and_resumes_exactly(how, cluster, whole, tmp_path):
    """``scontrol requeue``: Slurm sends SIGTERM, waits KillWait and requeues the job itself.
    ``scancel --signal=TERM`` (what ``--signal=TERM@60`` sends before the time limit): the
    job goes on running, and the batch script requeues it when the ranks exit 75."""
    job, run, out = _submit(cluster, tmp_path)
    try:
        at = _wait_for_steps(cluster, job, run / "metrics.jsonl", 10)
        cluster.run(*(["scontrol", "requeue", job] if how == "scontrol-requeue"
                      else ["scancel", "--signal=TERM", job]))
        fields = cluster.wait(job, timeout_s=240)
    finally:
        cluster.run("scancel", job, check=False)
    log = _log(out)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    marker = json.loads((run / "preempted.json").read_text())
    assert at <= marker["step"] < STEPS, (at, marker, log)
    assert "attempt 1" in log and f"resuming {run}/checkpoints/step-{marker['step']}" in log, log
    if how == "signal-term":
        assert f"requeueing job {job}" in log, log
    assert _final_files(run) == whole, f"preempted after step {marker['step']}"  # bit for bit


def test_a_cancelled_job_leaves_no_partial_checkpoint_and_stays_cancelled(cluster, tmp_path):
    job, run, out = _submit(cluster, tmp_path, "--steps", "100000", "--save-every", "3")
    try:
        _wait_for_steps(cluster, job, run / "metrics.jsonl", 8)
        cluster.run("scancel", job)
        # COMPLETING until the batch script has ended; a requeue from it would show as PENDING
        cluster.wait(job, states=("CANCELLED", "PENDING", "COMPLETED", "FAILED"), timeout_s=120)
        time.sleep(1)
        fields = cluster.job(job)
    finally:
        cluster.run("scancel", job, check=False)
    log = _log(out)
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), (fields, log)
    assert "left to Slurm" in log, log
    checkpoints = published(run)
    assert checkpoints, log
    for checkpoint in checkpoints:  # whatever was published is whole
        meta = json.loads((checkpoint / "meta.json").read_text())
        assert all((checkpoint / name).stat().st_size == info["bytes"] for name, info in meta["files"].items())
