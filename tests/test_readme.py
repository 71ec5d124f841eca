"""Every command the README shows runs as written.

The commands are the lines of the README's ``bash`` blocks (and each part of a line joined
with ``&&``) that start with ``paratrain`` or ``python -m paratrain`` (or run it under
``scripts/cluster.py``, whose part after ``--`` each node runs), in README order, in
one scratch directory (``examples/`` linked into it), so that later commands read what
earlier ones wrote. Training is shortened, and only that: ``--steps 8`` (set or appended),
``--save-every 4``, and a checkpoint named ``step-N`` read as ``step-4``; ``bench comm``
measures two sizes, two iterations.

A README comment ``[slow]`` marks a command the default run leaves out (it costs more than
this whole test); ``[needs: WHAT]`` marks one that needs what CI machines lack (a GPU,
several hosts). Keep both lists tiny.

- ``test_readme_commands_run`` (``-m slow``, minutes): every command but ``[needs: ...]``,
  each a real ``python -m paratrain`` process.
- ``test_readme_commands_reach_launch`` (default, seconds): every command in this process;
  ``paratrain train`` goes through parsing, validation, the checks against the machine and
  the data, and the run directory, up to starting its ranks, which are not started
  (``bench comm`` starts its two). The
  commands that read what a training wrote (a checkpoint, metrics, a timeline, an exported
  model) are therefore left to the slow test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARK = re.compile(r"\[(slow|needs: [^\]]+)\]")


def readme_commands() -> list[tuple[list[str], str]]:
    """(argv after ``paratrain``, its marker or '') of every README command, in order."""
    text = (REPO / "README.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            mark = MARK.search(line.partition(" #")[2])
            words = shlex.split(line, comments=True)
            while words:
                part, words = (words[:words.index("&&")], words[words.index("&&") + 1:]) if "&&" in words \
                    else (words, [])
                if part[:2] == ["python", "scripts/cluster.py"] and "--" in part:
                    part = ["python", *part[part.index("--") + 1:]]  # the command it runs per node
                if part[:1] == ["paratrain"] or part[:3] == ["python", "-m", "paratrain"]:
                    found.append((part[1:] if part[0] == "paratrain" else part[3:],
                                  mark.group(1) if mark else ""))
    return found


def shorten(argv: list[str]) -> list[str]:
    """The command with fewer steps (see the module doc); nothing else changes."""
    argv = [re.sub(r"checkpoints/step-\d+", "checkpoints/step-4", a) for a in argv]
    if argv[:2] == ["bench", "comm"]:
        return argv + ["--sizes", "1K,64K", "--iters", "2", "--warmup", "1"]
    if argv[:1] != ["train"] or "--help" in argv:
        return argv
    for flag, value in (("--steps", "8"), ("--save-every", "4")):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        elif flag == "--steps":
            argv += [flag, value]
    return argv


def scratch(tmp_path: Path) -> Path:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    return tmp_path


def test_the_readme_has_commands_and_few_marked():
    commands = readme_commands()
    assert len(commands) >= 30
    assert sum(bool(mark) for _, mark in commands) <= 2
    assert ["train", "--help"] in [argv for argv, _ in commands]


def reads_a_training(argv: list[str]) -> bool:
    """Whether the command reads what a training wrote (left out where ranks do not run)."""
    return (argv[0] in ("report", "export") or "--run" in argv
            or any("checkpoints/step-" in a for a in argv) or "my_llama" in argv)


def test_readme_commands_reach_launch(tmp_path, monkeypatch):
    from paratrain import cli, launch
    from paratrain.plan.hardware import DEFAULT_CALIBRATION
    from paratrain.train.worker import run_worker

    monkeypatch.chdir(scratch(tmp_path))
    launched = []
    spawn = launch.spawn

    def spawn_all_but_training(fn, nproc, *args, **kwargs):
        if fn is run_worker:
            return launched.append(nproc)
        return spawn(fn, nproc, *args, **kwargs)  # bench comm: two sizes, two iterations

    monkeypatch.setattr(launch, "spawn", spawn_all_but_training)
    ran = 0
    for argv, mark in readme_commands():
        argv = shorten(argv)
        if mark or reads_a_training(argv) or ({"local", "local.toml"} & set(argv) and not DEFAULT_CALIBRATION.is_file()):
            continue
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # --help
            code = exc.code
        assert code == 0, f"`paratrain {shlex.join(argv)}` exited with {code}"
        ran += 1
    assert ran >= 25 and len(launched) >= 15 and 8 in launched


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_readme_commands_run(tmp_path):
    cwd = scratch(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HOME": str(tmp_path)}  # calibration: here
    for argv, mark in readme_commands():
        if mark.startswith("needs"):
            continue
        argv = shorten(argv)
        done = subprocess.run([sys.executable, "-m", "paratrain", *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"`paratrain {shlex.join(argv)}`:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
