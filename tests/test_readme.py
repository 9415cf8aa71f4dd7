"""Every command block of README.md runs as written on a fresh clone, in order.

The clone is a copy of this checkout's files (git's list: tracked and not ignored) beside ../shared, using this
environment (.venv links to it; scripts/install.sh is a stand-in there: the real one downloads, and is tested in
test_scripts.py). `bash scripts/test.sh` is the one line not run (it is this suite). A block that starts servers
runs its other lines first, then each server in turn, in the background on a free loopback port (in place of the
README's 8000), with every client block (curl, the OpenAI client) run against it before it is stopped with
SIGTERM, as a person would; every other block runs as one bash (or python) script, in the clone, in order.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED_MODELS
from jobs import ROOT, Job

FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.M | re.S)
SERVER = re.compile(r"runner serve|Server\.py")
NOT_RUN = "bash scripts/test.sh"
CONTINUED = re.compile(r"\\\n\s*")
BLOCK_TIMEOUT = 600


def readme_blocks() -> list[tuple[str, str]]:
    return FENCE.findall((ROOT / "README.md").read_text())


def is_client(lang: str, code: str) -> bool:
    return ("curl " in code) if lang == "bash" else "OpenAI(" in code


def fresh_clone(base: Path) -> Path:
    clone = base / "clone"
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file() and not src.is_symlink():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / name)
    (clone / "scripts" / "install.sh").write_text("echo 'install: (a stand-in: this environment is used)'\n")
    (clone / ".venv").symlink_to(Path(sys.executable).parents[1])
    (base / "shared").symlink_to(SHARED_MODELS.parent)
    return clone


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_block(lang: str, code: str, clone: Path, out_dir: Path, port: int = 8000) -> str:
    code = code.replace("localhost:8000", f"127.0.0.1:{port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    cmd = ["bash", "-e", "-o", "pipefail", "-c", f'cd "{clone}"\n{code}'] if lang == "bash" else \
        [sys.executable, "-c", f"import os; os.chdir({str(clone)!r})\n{code}"]
    with Job(cmd, out_dir, {"PYTHONPATH": str(clone)}) as job:
        rc = job.wait(BLOCK_TIMEOUT)
        assert rc == 0, f"README block failed ({rc}):\n{code}\n--- stdout\n{job.stdout[-3000:]}\n--- stderr\n" \
                        f"{job.stderr[-3000:]}"
        assert not job.lingering(), f"processes outlived the block:\n{code}"
        return job.stdout


def serve_with_clients(line: str, clients: list, clone: Path, out_dir: Path) -> None:
    port = free_port()
    line = line.replace("--port 8000", f"--port {port}") if "--port 8000" in line else \
        SERVER.sub(lambda m: f"{m.group(0)} --port {port}", line, count=1)  # the default port is 8000 too
    cmd = ["bash", "-c", f'cd "{clone}"\n. .venv/bin/activate\nexec {line}']
    with Job(cmd, out_dir, {"PYTHONPATH": str(clone)}) as job:
        job.wait_for("serving ", BLOCK_TIMEOUT)
        for lang, code in clients:
            out = run_block(lang, code, clone, out_dir, port)
            assert '"error"' not in out and "there was" in out, f"{line}\n{code}\n{out[-3000:]}"
        job.proc.terminate()
        job.wait(60)
        assert "server stopped" in job.stderr and not job.lingering(), job.stderr[-3000:]


def test_every_readme_command_block_runs_as_written(tmp_path):
    if not (SHARED_MODELS / "stories260k" / "config.json").is_file():
        pytest.skip(f"{SHARED_MODELS} not found: the README's commands use ../shared/models")
    if sys.prefix == sys.base_prefix:
        pytest.skip("the README's commands use .venv: run the tests from a virtual environment")
    clone, out_dir = fresh_clone(tmp_path), tmp_path / "jobs"
    out_dir.mkdir()
    blocks = readme_blocks()
    assert NOT_RUN in blocks[0][1] and "bash scripts/demo.sh" in blocks[0][1]
    clients = [b for b in blocks if is_client(*b)]
    assert len(clients) == 2
    servers_run = 0
    for lang, code in blocks:
        if is_client(lang, code):
            continue  # run against each server of the block before them
        code = CONTINUED.sub(" ", code)  # a command continued over lines (`\\` at the end) is one line
        lines = [ln for ln in code.splitlines() if not ln.startswith(NOT_RUN)]
        servers = [ln for ln in lines if SERVER.search(ln)]
        run_block(lang, "\n".join(ln for ln in lines if ln not in servers), clone, out_dir)
        for line in servers:
            serve_with_clients(line, clients, clone, out_dir)
            servers_run += 1
    assert servers_run == 5
