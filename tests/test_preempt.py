"""Preemption: SIGTERM (or SIGUSR1) at a random step saves after that step and exits
resumable (75); ``--resume auto`` then ends with the uninterrupted run's exact state,
under paratrain's launcher and under torchrun (SIGUSR1 and torchrun: ``-m slow``). A second
signal stops the rank at once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from helpers import LONG_RUN as RUN, LONG_STEPS as STEPS, final_files as _final_files
from test_faults import wait_for_steps

from paratrain.train.preempt import EXIT_PREEMPTED
from paratrain.train.saved import published


def _train(background, run_dir, *extra: str, torchrun: bool = False) -> subprocess.Popen:
    if torchrun:
        from test_launch import free_port

        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}", "-m",
                    "paratrain", "train", *[a for a in RUN if a not in ("--nproc", "2")]]
    else:
        launcher = [sys.executable, "-m", "paratrain", "train", *RUN]
    return background([*launcher, "--run-dir", str(run_dir), *extra], cwd=run_dir.parent,
                      env={**os.environ, "TMPDIR": str(run_dir.parent)},
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _whole(background, tmp_path, torchrun: bool) -> dict:
    """The final files of the uninterrupted run under ``torchrun``."""
    whole = tmp_path / "whole"
    whole.mkdir()
    done = _train(background, whole, torchrun=torchrun)
    assert done.wait(timeout=300) == 0, done.communicate()[0][-3000:]
    return _final_files(whole)


def _preempt_and_resume(background, tmp_path, want: dict, torchrun: bool, sig: int = signal.SIGTERM) -> None:
    """Signalled at a random step, resumed: it ends with the files ``want``."""
    cut = tmp_path / "cut"
    cut.mkdir()
    at = random.Random().randint(2, 12)
    job = _train(background, cut, torchrun=torchrun)
    wait_for_steps(job, cut / "metrics.jsonl", at)
    job.send_signal(sig)
    output = job.communicate(timeout=300)[0]
    assert job.returncode != 0, output[-3000:]
    marker = json.loads((cut / "preempted.json").read_text())
    assert at <= marker["step"] < STEPS, (at, marker, output[-3000:])
    if not torchrun:  # torchrun reports its workers' failure with its own status
        assert job.returncode == EXIT_PREEMPTED and f"preempted after step {marker['step']}" in output
    assert [p.name for p in published(cut)] == [f"step-{marker['step']}"]
    resumed = _train(background, cut, "--resume", "auto", torchrun=torchrun)
    assert resumed.wait(timeout=300) == 0, resumed.communicate()[0][-3000:]
    assert _final_files(cut) == want, f"signalled after step {at}"  # bit for bit


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.slow)])
def test_a_signal_at_a_random_step_resumes_to_the_uninterrupted_state(sig, tmp_path, background, uninterrupted):
    """(The uninterrupted run under paratrain's launcher is conftest's, shared with test_slurm.)"""
    _preempt_and_resume(background, tmp_path, uninterrupted, torchrun=False, sig=sig)


@pytest.mark.slow
def test_sigterm_under_torchrun_resumes_to_the_uninterrupted_state(tmp_path, background):
    """torchrun passes its SIGTERM to the workers, which save and end."""
    _preempt_and_resume(background, tmp_path, _whole(background, tmp_path, torchrun=True), torchrun=True)


def signalled_twice() -> None:
    """A rank preemptible (with its launcher's watchdog) gets SIGTERM, then another."""
    import time

    from paratrain.train.preempt import Preemption

    with Preemption():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # not reached: the second signal ends the rank at once


def test_a_second_signal_stops_the_rank_at_once():
    """(What it may leave half-written is never published: tests/test_async_save.py and
    test_checkpoint.py kill ranks mid-save.)"""
    from distributed import run_world
    from paratrain.launch import RankFailed

    with pytest.raises(RankFailed, match="exited with code 143"):
        run_world(signalled_twice, 1, timeout_s=60)

def signalled_while_preemptible() -> int:
    """A rank (with its launcher's watchdog) sends itself SIGTERM while the loop's handler
    is installed and stays for longer than the watchdog's patience."""
    import time

    from paratrain.train.preempt import Preemption

    with Preemption() as preempt:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2.5)
    return preempt.signals


def test_the_watchdog_leaves_sigterm_to_the_loop_while_its_parent_lives():
    from distributed import run_world

    assert run_world(signalled_while_preemptible, 1) == [1]
