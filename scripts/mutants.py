"""Mutation check: apply each deliberate bug ("mutant") to a copy of the repository, run the
tests that must catch it, and report caught / MISSED.

Mutants are data, in ``scripts/mutants/*.toml`` (any number of files)::

    [[mutant]]
    name = "short-kebab-name"
    file = "src/paratrain/....py"        # relative to the repository root
    function = "place"                    # optional: search only this function (or Class.method)
    old = '''text that occurs exactly once there, indentation ignored'''
    new = '''the buggy replacement (re-indented to where old sits)'''
    tests = ["tests/test_x.py::test_y"]  # pytest node ids that must fail
    ci = false                            # true: a fast one, run by --ci
    why = "what bug this models"

Usage (from the repository root)::

    python scripts/mutants.py              # every mutant (long: tens of minutes on 2 cores)
    python scripts/mutants.py --ci         # the fast subset (tests/test_mutants.py runs it)
    python scripts/mutants.py --only NAME [--only NAME2]
    python scripts/mutants.py --jobs 2     # two mutants at a time, each in its own copy
    python scripts/mutants.py --list

Mutants find their place by content (scripts/mutant_locate.py): the lines of ``old`` match
whatever their indentation, inside ``function`` when one is named, so a refactor that keeps
behaviour (a block moved into a helper, code re-indented) does not re-point them.

Before any mutant, the selected mutants' tests run once on the unmutated copy and must pass
(otherwise every mutant would look caught). A mutant counts as caught when its tests fail;
a run past ``--timeout`` is reported as TIMEOUT and counts as not caught. Exit code: 0 when
every mutant is caught, 1 when one is not, 2 for a malformed mutant file.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutant_locate as locate  # noqa: E402  (beside this script, which is not a package)

ROOT = Path(__file__).resolve().parent.parent
MUTANT_DIR = ROOT / "scripts" / "mutants"
FIELDS = {"name": str, "file": str, "function": str, "old": str, "new": str, "tests": list, "ci": bool, "why": str}
REQUIRED = ("name", "file", "old", "new", "tests", "why")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    ci: bool
    why: str
    source: str
    """The .toml file it came from."""
    function: str = ""
    """Where in the file ``old`` is looked for ('' : anywhere)."""

    def apply(self, text: str) -> str:
        return locate.apply(text, self.old, self.new, self.function)


def load_mutants(directory: Path = MUTANT_DIR, root: Path = ROOT) -> list[Mutant]:
    """Every mutant of every ``*.toml`` in ``directory``, validated against ``root``; raises
    ValueError listing every problem found."""
    problems, mutants, seen = [], [], {}
    files = sorted(directory.glob("*.toml"))
    if not files:
        raise ValueError(f"no mutant files (*.toml) in {directory}")
    for path in files:
        try:
            entries = tomllib.loads(path.read_text()).get("mutant", [])
        except tomllib.TOMLDecodeError as exc:
            problems.append(f"{path.name}: not valid TOML: {exc}")
            continue
        for i, entry in enumerate(entries):
            where = f"{path.name} mutant #{i + 1} ({entry.get('name', '?')})"
            errors = _check_entry(entry, root)
            name = entry.get("name")
            if isinstance(name, str) and name in seen:
                errors.append(f"name already used in {seen[name]}")
            problems += [f"{where}: {e}" for e in errors]
            if not errors:
                seen[name] = path.name
                mutants.append(Mutant(name, entry["file"], entry["old"], entry["new"],
                                      tuple(entry["tests"]), entry.get("ci", False), entry["why"],
                                      path.name, entry.get("function", "")))
    if problems:
        raise ValueError("malformed mutants:\n  " + "\n  ".join(problems))
    return mutants


def _check_entry(entry: dict, root: Path) -> list[str]:
    errors = [f"missing field {f!r}" for f in REQUIRED if f not in entry]
    errors += [f"unknown field {f!r} (known: {', '.join(FIELDS)})" for f in entry if f not in FIELDS]
    errors += [f"{f!r} must be a {t.__name__}" for f, t in FIELDS.items()
               if f in entry and not isinstance(entry[f], t)]
    if errors:
        return errors
    if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", entry["name"]):
        errors.append("name must be short-kebab-case")
    target = root / entry["file"]
    if not target.is_file():
        return errors + [f"file {entry['file']} does not exist"]
    where = f"{entry['file']}" + (f" in {entry['function']}" if entry.get("function") else "")
    try:
        count = locate.count(target.read_text(), entry["old"], entry.get("function", ""))
    except (ValueError, SyntaxError) as exc:
        return errors + [f"{where}: {exc}"]
    if count != 1:
        errors.append(f"'old' occurs {count} times in {where} (must be exactly once)")
    if entry["old"] == entry["new"]:
        errors.append("'new' equals 'old'")
    if not entry["tests"]:
        errors.append("'tests' is empty")
    for node in entry["tests"]:
        errors += _check_node(node, root)
    return errors


def _check_node(node: str, root: Path) -> list[str]:
    """A pytest node id ``path[::name[[params]]]`` whose file exists and defines the test."""
    if not isinstance(node, str):
        return [f"test {node!r} is not a string"]
    path, _, rest = node.partition("::")
    if not (root / path).is_file():
        return [f"test file {path} does not exist"]
    func = rest.split("::")[-1].split("[")[0]
    if func and not re.search(rf"^\s*def {re.escape(func)}\(", (root / path).read_text(), re.M):
        return [f"test {func} is not defined in {path}"]
    return []


def copy_repo(dest: Path) -> None:
    """The repository's files (tracked, and untracked ones git does not ignore) into ``dest``."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                                check=True, capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc", "runs"))
        return
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """Run ``tests`` in ``copy`` against its own sources: ('pass' | 'fail' | 'timeout' |
    'error', seconds, output tail). 'error' is pytest's usage / no-tests exit (4, 5)."""
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.perf_counter()
    # Its own session, so that a timeout ends pytest's whole tree: a mutant that breaks a
    # job's exit would otherwise leave ranks computing through every later mutant's timing.
    pytest = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        out, err = pytest.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(pytest.pid, signal.SIGKILL)
        out, _ = pytest.communicate()
        return "timeout", time.perf_counter() - start, out[-2000:]
    seconds = time.perf_counter() - start
    tail = (out + err)[-4000:]
    if pytest.returncode == 0:
        return "pass", seconds, tail
    return ("error" if pytest.returncode in (4, 5) else "fail"), seconds, tail


def check(mutants: list[Mutant], timeout: float, baseline: bool = True, jobs: int = 1) -> int:
    """Apply each mutant to a temporary copy, ``jobs`` copies (and mutants) at a time; print
    one line each and a summary."""
    with tempfile.TemporaryDirectory(prefix="paratrain-mutants-") as tmp:
        copies: queue.Queue[Path] = queue.Queue()
        for i in range(max(1, min(jobs, len(mutants)))):
            copy = Path(tmp) / str(i)
            copy_repo(copy)
            copies.put(copy)
        if baseline and not _baseline(copies.queue[0], mutants, timeout):
            return 2
        lock = threading.Lock()

        def one(m: Mutant) -> bool:  # caught?
            copy = copies.get()
            target = copy / m.file
            original = target.read_text()
            target.write_text(m.apply(original))
            try:
                status, seconds, tail = run_tests(copy, m.tests, timeout)
            finally:
                target.write_text(original)
                copies.put(copy)
            with lock:
                _report(m, status, seconds, tail)
            return status == "fail"

        with ThreadPoolExecutor(copies.qsize()) as pool:
            caught = list(pool.map(one, mutants))
    missed = [m.name for m, ok in zip(mutants, caught) if not ok]
    print(f"summary: {len(mutants) - len(missed)}/{len(mutants)} mutants caught"
          + (f"; not caught: {', '.join(missed)}" if missed else ""), flush=True)
    return 1 if missed else 0


def _baseline(copy: Path, mutants: list[Mutant], timeout: float) -> bool:
    """The selected mutants' tests pass on the unmutated copy (else every mutant looks caught)."""
    tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
    status, seconds, tail = run_tests(copy, tests, timeout * 2)
    if status != "pass":
        print(f"baseline: the unmutated tests do not pass ({status}, {seconds:.0f} s); "
              f"fix them first\n{tail}", flush=True)
        return False
    print(f"baseline: {len(tests)} tests pass unmutated ({seconds:.0f} s)", flush=True)
    return True


def _report(m: Mutant, status: str, seconds: float, tail: str) -> None:
    verdict = {"fail": "caught", "pass": "MISSED", "timeout": "TIMEOUT", "error": "ERROR"}[status]
    print(f"{verdict:8s} {m.name:40s} {seconds:6.1f} s  {m.file}", flush=True)
    if status == "fail":  # say which test failed, and how
        failed = [ln for ln in tail.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        print(f"         {(failed or ['(see pytest output)'])[0][:200]}", flush=True)
    else:
        print("         " + tail.strip().replace("\n", "\n         ")[-1200:], flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ci", action="store_true", help="only the mutants marked ci = true")
    parser.add_argument("--only", action="append", metavar="NAME", help="only this mutant (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds per mutant's test run (default 900)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip running the tests on the unmutated copy first")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="mutants tested at a time, each in its own copy (default 1; single-"
                             "process tests leave a core idle, so 2 suits a 2-core machine)")
    parser.add_argument("--dir", type=Path, default=MUTANT_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        mutants = load_mutants(args.dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.ci:
        mutants = [m for m in mutants if m.ci]
    if args.only:
        unknown = set(args.only) - {m.name for m in mutants}
        if unknown:
            print(f"error: no mutant named {', '.join(sorted(unknown))}"
                  f"{' among the ci ones' if args.ci else ''} (see --list)", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:40s} {'ci ' if m.ci else '   '} {m.source:14s} {m.file}\n"
                  f"    {m.why}\n    tests: {' '.join(m.tests)}")
        return 0
    if not mutants:
        print("error: no mutants selected", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("error: --jobs must be at least 1", file=sys.stderr)
        return 2
    return check(mutants, args.timeout, baseline=not args.no_baseline, jobs=args.jobs)


if __name__ == "__main__":
    sys.exit(main())
