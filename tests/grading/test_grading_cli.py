"""The `qlab` command line: subcommands and its error paths (no kernels started)."""

from __future__ import annotations

import pytest

from qlab.cli import main


def test_subcommands_listed(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "assign" in out and "grade" in out


def test_grade_needs_out(capsys):
    with pytest.raises(SystemExit) as e:
        main(["grade", "x.ipynb"])
    assert e.value.code == 2


def test_grade_missing_path(tmp_path, capsys):
    assert main(["grade", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_grade_empty_folder(tmp_path, capsys):
    (tmp_path / "subs").mkdir()
    assert main(["grade", str(tmp_path / "subs"), "--out", str(tmp_path / "o"), "--quiet"]) == 1
    assert "no notebooks" in capsys.readouterr().err


def test_grade_bad_env(tmp_path, capsys):
    assert main(["grade", str(tmp_path), "--out", str(tmp_path / "o"), "--env", "NOEQUALS"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_grade_merge_is_a_subcommand(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["grade", "merge", "--help"])
    assert e.value.code == 0
    assert "shard" in capsys.readouterr().out
    assert main(["grade", "merge", str(tmp_path), "--out", str(tmp_path / "m")]) == 2
    assert "no grades.json" in capsys.readouterr().err


def test_an_empty_shard_is_not_an_error(tmp_path, capsys):
    (tmp_path / "subs").mkdir()
    argv = ["grade", str(tmp_path / "subs"), "--out", str(tmp_path / "o"), "--quiet"]
    assert main([*argv, "--shard", "2/3", "--seed", "5", "--sandbox", "off"]) == 0
    assert "no submissions fall in shard 2/3" in capsys.readouterr().out
    assert (tmp_path / "o" / "shard-2-of-3" / "grades.json").exists()
