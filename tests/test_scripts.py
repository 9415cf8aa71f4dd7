"""The ppl.pmx-compatible scripts work with the ppl.pmx flags."""

from __future__ import annotations

import filecmp
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script(name, *args):
    res = subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_convert_split_merge_scripts(shared_model, tmp_path):
    out = script("ConvertWeightToPmx.py", "--input_dir", shared_model("stories260k"), "--output_dir", tmp_path / "pmx")
    assert "LlamaForCausalLM" in out
    out = script("Split.py", "--input_dir", tmp_path / "pmx", "--num_shards", 8, "--output_dir", tmp_path / "pmx8")
    assert "8 shards" in out and "intermediate_dim" in out
    script("Merge.py", "--input_dir", tmp_path / "pmx8", "--num_shards", 8, "--output_dir", tmp_path / "merged")
    assert filecmp.cmp(tmp_path / "pmx" / "model.00.safetensors", tmp_path / "merged" / "model.00.safetensors",
                       shallow=False)
    assert (tmp_path / "merged" / "tokenizer.model").is_file()


def test_help_lists_flags():
    res = subprocess.run([sys.executable, str(SCRIPTS / "Split.py"), "--help"], capture_output=True, text=True,
                         env={"PAGER": "cat", "PATH": "/usr/bin:/bin"})
    text = res.stdout + res.stderr
    assert res.returncode == 0 and "num_shards" in text.lower() and "--overwrite" in text


FAKE_PYTHON = """#!/bin/sh
# an interpreter stand-in: logs its arguments; "-m venv DIR" makes DIR/bin/python (this script)
echo "$*" >> "$FAKE_LOG"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
[ "$1" = "--version" ] && echo "Python 3.x"
exit 0
"""


def test_install_says_what_it_does(tmp_path):
    """scripts/install.sh (~100 s the first time) prints each step and how long it took, then once installed, one
    line; torch stays pinned. Run on a copy, with a stand-in interpreter (no download)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("scripts/install.sh", "pyproject.toml"):
        (repo / name).write_bytes((SCRIPTS.parent / name).read_bytes())
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "FAKE_LOG": str(tmp_path / "log")}

    def install():
        res = subprocess.run(["bash", str(repo / "scripts" / "install.sh")], capture_output=True, text=True, env=env,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        return res.stdout.splitlines()

    lines = install()
    steps = [ln for ln in lines if ln.endswith(" ...")]
    assert [ln.split(" (")[0].removesuffix(" ...") for ln in steps] == [
        "install: creating the virtual environment .venv", "install: upgrading pip", "install: installing torch 2.13.0",
        "install: installing pmx-runner", "install: compiling the installed modules' bytecode",
        "install: checking the imports"], lines
    assert sum(ln.startswith("install:   done in ") for ln in lines) == len(steps) and lines[-1].startswith(
        "install: ready in ")
    log = (tmp_path / "log").read_text()
    assert "-m pip install -q --no-compile torch==2.13.0" in log and "-m compileall -q -j 0 " in log
    assert install() == ["install: .venv is up to date"]


def test_test_sh_shows_progress_and_the_slowest_tests(tmp_path):
    """scripts/test.sh names each test with its file and progress (on two pytest-xdist workers: the worker too) and
    ends with the slowest tests (pyproject's addopts), rather than 15 minutes of dots. Run from a copy whose install.sh
    is a stand-in (the real one is test_install_says_what_it_does's), over this checkout's tests and environment."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "test.sh").write_bytes((SCRIPTS / "test.sh").read_bytes())
    (repo / "scripts" / "install.sh").write_text("echo 'install: (a stand-in)'\n")
    (repo / "pyproject.toml").write_bytes((SCRIPTS.parent / "pyproject.toml").read_bytes())
    (repo / "tests").symlink_to(SCRIPTS.parent / "tests")
    (repo / ".venv").symlink_to(Path(sys.executable).parents[1])
    res = subprocess.run(["bash", str(repo / "scripts" / "test.sh"), "tests/test_launch.py", "-k",
                          "rank_from_the_environment", "-p", "no:cacheprovider"], capture_output=True, text=True,
                         timeout=300, cwd=repo, env={**os.environ, "PMX_TEST_LEFTOVERS_CHECK": "0"})
    # (the outer run checks for leftovers: a torchrun job of its other worker had been counted as this run's)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"^\[gw[01]\] \[100%\] PASSED tests/test_launch\.py::\S*rank_from_the_environment", res.stdout,
                     re.M), res.stdout
    assert "slowest 25 durations" in res.stdout, res.stdout
