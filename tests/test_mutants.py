"""The mutation check's CI subset: a few fast deliberate bugs from scripts/mutants/*.toml,
each applied to a temporary copy of the repository, must make their tests fail (behind
-m slow: 3-4 minutes). The default suite checks that every mutant still finds its place.
The full check (every mutant; tens of minutes) is `python scripts/mutants.py`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "mutants.py"


def test_every_mutant_file_is_well_formed():
    done = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("tests:") >= 12


@pytest.mark.slow  # 3-4 minutes on 2 cores: a sixth of the suite (-m slow, README)
@pytest.mark.timeout(600)  # more on a loaded machine (the subprocess's own limit)
def test_ci_mutants_are_caught():
    # No baseline run: the suite runs every one of these tests unmutated anyway, and a
    # failing one shows there (the baseline cost 35 s of a 2-minute check). Two at a time:
    # most of these tests run in one process, and the suite leaves the second core idle.
    done = subprocess.run([sys.executable, str(SCRIPT), "--ci", "--no-baseline", "--jobs", "2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "MISSED" not in done.stdout and "caught" in done.stdout


def test_malformed_mutants_are_refused(tmp_path):
    (tmp_path / "bad.toml").write_text(
        '[[mutant]]\nname = "x"\nfile = "src/paratrain/optim.py"\nold = "return"\nnew = "pass"\n'
        'tests = ["tests/nothing.py"]\nwhy = "y"\n')
    done = subprocess.run([sys.executable, str(SCRIPT), "--list", "--dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert "occurs" in done.stderr and "tests/nothing.py does not exist" in done.stderr


def test_a_mutant_finds_its_place_after_a_refactor_that_keeps_behaviour():
    """A mutant survives its code moving into a block or a helper (indentation ignored) and
    a pattern common in the file (``function`` scopes it); ``new`` takes the match's indent."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import mutant_locate as locate

    before = "def f(x):\n    if x:\n        return 1\n    return 0\n"
    after = "def g(y):\n    if y:\n        return 1\n\n\nclass A:\n    def f(self, x):\n        if x:\n            return 1\n        return 0\n"
    old, new = "if x:\n    return 1", "if not x:\n    return 1"
    assert locate.apply(before, old, new) == before.replace("if x:", "if not x:")
    assert locate.count(after, old) == 1  # re-indented into a method: still found
    assert locate.apply(after, old, new) == after.replace("if x:", "if not x:")
    assert locate.count(after, "return 1") == 2 and locate.count(after, "return 1", "A.f") == 1
    assert locate.apply(after, "    if x:\n        return 1", "    if x:\n        return 2\n    print()", "f").endswith(
        "        if x:\n            return 2\n        print()\n        return 0\n")  # shifted by 4
    with pytest.raises(ValueError, match="defined 0 times"):
        locate.count(after, "return 1", "h")


def test_every_mutant_applies_to_code_that_compiles():
    """A mutant that breaks the syntax is 'caught' by any test: it must change behaviour."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import mutants

    broken = []
    for m in mutants.load_mutants():
        if m.file.endswith(".py"):
            try:
                compile(m.apply((ROOT / m.file).read_text()), m.file, "exec")
            except SyntaxError as exc:
                broken.append(f"{m.name}: {exc}")
    assert not broken, broken
