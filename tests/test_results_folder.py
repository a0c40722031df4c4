"""results/ exists in every clone (with its README), while what runs write into it stays untracked."""
import os
import shutil
import subprocess

import pytest

from .helpers import REPO


def ignored(path: str) -> bool:
    """git's own answer: exit 0 when the path is ignored, 1 when it is not."""
    result = subprocess.run(["git", "-C", REPO, "check-ignore", "-q", path], capture_output=True)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode == 0


@pytest.fixture
def git_checkout():
    inside = shutil.which("git") and subprocess.run(["git", "-C", REPO, "rev-parse", "--is-inside-work-tree"],
                                                    capture_output=True).returncode == 0
    if not inside:
        pytest.skip("not a git checkout (an installed copy has no .gitignore to check)")


def test_results_folder_ships_its_readme_and_ignores_what_runs_write(git_checkout):
    assert os.path.isfile(os.path.join(REPO, "results", "README.md"))
    assert not ignored("results/README.md")
    for written in ("results/results.db", "results/gate/1-tiny-resident-arith-abc.json", "results/report/index.html"):
        assert ignored(written), written
    assert not ignored("evalsuite/results/database.py")  # the package of the same name is source
