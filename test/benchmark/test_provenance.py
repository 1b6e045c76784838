"""benchmark/provenance.py on CPU: a results file's provenance names the commit and says whether the
tree was dirty (and which files); without git it reads the stamp written before a device run; with
neither it says "unknown" rather than guessing."""

import json
import pathlib
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmark"))

import provenance as P  # noqa: E402


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "-q", "-m", "one")
    monkeypatch.setattr(P, "ROOT", str(tmp_path))
    monkeypatch.setattr(P, "STAMP", str(tmp_path / ".provenance.json"))
    return tmp_path


def head(repo) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def test_a_clean_checkout_names_its_commit_and_is_not_dirty(repo):
    p = P.provenance("toy model: 2 layers, hidden 64", ["FlashMLA: torch reference"], argv=[str(repo / "b.py"), "-x"])
    assert (p["commit"], p["dirty"], p["dirty_files"], p["source"]) == (head(repo), False, [], "git")
    assert p["command"] == "python b.py -x"
    assert p["model"] == "toy model: 2 layers, hidden 64" and p["stand_ins"] == ["FlashMLA: torch reference"]
    assert p["machine"]["cores"] >= 1 and p["date_utc"].endswith("+00:00")


def test_a_modified_tracked_file_makes_the_tree_dirty_and_is_named(repo):
    (repo / "a.py").write_text("x = 2\n")
    p = P.provenance("m")
    assert p["dirty"] is True and p["dirty_files"] == ["a.py"] and p["diff_sha256"]
    (repo / "a.py").write_text("x = 3\n")
    assert P.provenance("m")["diff_sha256"] != p["diff_sha256"], "a different edit must give another diff hash"


def test_the_stamp_is_believed_only_while_the_tree_is_unchanged(repo, monkeypatch):
    stamped = P.stamp()
    assert json.loads((repo / ".provenance.json").read_text())["commit"] == head(repo)
    (repo / "b.py").write_text("y = 1\n")
    git(repo, "add", "b.py")
    git(repo, "commit", "-q", "-m", "two")
    (repo / "b.py").unlink()  # the stamp's tree again, while the copy's .git is newer (or older) than it
    p = P.provenance("m")
    assert (p["commit"], p["dirty"]) == (stamped["commit"], False) and p["source"].startswith("stamp")
    (repo / "a.py").write_text("x = 5\n")  # edited after the stamp: git's view, not the stamp's
    p = P.provenance("m")
    assert (p["commit"], p["dirty"], p["source"]) == (head(repo), True, "git")


def test_without_git_or_a_valid_stamp_nothing_is_guessed(repo, monkeypatch):
    P.stamp()
    (repo / "a.py").write_text("x = 6\n")
    monkeypatch.setattr(P, "git_state", lambda: None)  # a copy without .git
    assert (P.provenance("m")["commit"], P.provenance("m")["source"]) == ("unknown", "none")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
