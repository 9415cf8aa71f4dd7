"""Flags: list-valued flags, typed values through fire, unknown flags, --help."""

import math
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import pytest

from runner.args import OneOf, Range, flags_of, int_list, items
from runner.cli import COMMANDS, main, run
from runner.errors import PmxError

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("value", ["0,1,39", "0 1 39", (0, 1, 39), [0, "1", 39]])
def test_int_list_forms(value):
    assert int_list(value, "dump_steps") == [0, 1, 39]


def test_int_list_edges_and_errors():
    assert int_list(None, "dump_steps") == [] and int_list("", "dump_steps") == [] and int_list(7, "x") == [7]
    with pytest.raises(PmxError, match=r"--batch_sizes must be positive integers separated by commas or spaces, got '1,0'"):
        int_list("1,0", "batch_sizes", minimum=1)
    with pytest.raises(PmxError, match="--batch_sizes must be positive integers"):
        int_list("", "batch_sizes", minimum=1, allow_empty=False)
    with pytest.raises(PmxError, match=r"--dump_steps must be integers >= 0 .* got 'a,1'"):
        int_list("a,1", "dump_steps")
    assert items("logits,kv_cache") == ["logits", "kv_cache"] and items(("logits",)) == ["logits"]


# --- flags as typed, through fire ------------------------------------------------------------------------
def command_recording(calls: list):
    def cmd(name: str, text: Optional[str] = None, flag: bool = False, n: Annotated[int, Range(1)] = 3,
            x: float = 0.5, mode: Annotated[str, OneOf("a", "b")] = "a") -> None:
        """A command for the tests.

        Args:
            name: a name.
            text: any text, kept as typed.
            flag: a switch.
            n: a count of at least 1.
            x: a number.
            mode: a or b.
        """
        calls.append(dict(name=name, text=text, flag=flag, n=n, x=x, mode=mode))
    return cmd


def call(argv: list) -> dict:
    calls: list = []
    run(command_recording(calls), argv, prog="cmd")
    assert len(calls) == 1
    return calls[0]


@pytest.mark.parametrize("typed,want", [("Hello, world", "Hello, world"), ("None", "None"), ("1,2", "1,2"),
                                        ("007", "007"), ("[1, 2]", "[1, 2]"), ("True", "True"), ("-1", "-1")])
def test_string_flags_stay_the_exact_string(typed, want):
    assert call(["--name", "x", "--text", typed])["text"] == want
    assert call([f"--name={typed}"])["name"] == want


@pytest.mark.parametrize("typed,want", [("true", True), ("FALSE", False), ("Yes", True), ("no", False), ("1", True),
                                        ("0", False)])
def test_bool_flags(typed, want):
    assert call(["x", "--flag", typed])["flag"] is want
    assert call(["x", f"--flag={typed}"])["flag"] is want


def test_bool_flag_forms_and_numbers():
    assert call(["x", "--flag"])["flag"] is True and call(["x", "--noflag"])["flag"] is False
    assert call(["x", "--flag", "--n", "7"])["n"] == 7 and call(["--name", "x", "--x", "1e-3"])["x"] == 0.001
    assert call(["--name", "x", "--mode", "b", "--x", "-2"]) == dict(name="x", text=None, flag=False, n=3, x=-2.0,
                                                                       mode="b")


@pytest.mark.parametrize("argv,message", [
    (["x", "--flag", "maybe"], "error: --flag takes true/false, yes/no or 1/0, got 'maybe'"),
    (["x", "--n", "abc"], "error: --n must be an integer, got 'abc'"),
    (["x", "--n", "2.5"], "error: --n must be an integer, got '2.5'"),
    (["x", "--n", "0"], "error: --n must be >= 1, got 0"),
    (["x", "--x", "abc"], "error: --x must be a number, got 'abc'"),
    (["x", "--x", "nan", "--n", "1"], None),
    (["x", "--mode", "c"], "error: --mode must be one of a, b, got 'c'"),
    (["x", "--nmae", "y"], "error: cmd: unknown flag --nmae; did you mean --name?"),
    (["x", "--mdoe=a"], "error: cmd: unknown flag --mdoe; did you mean --mode?"),
    (["x", "-n", "3"], "error: cmd: unknown flag -n; did you mean --n?"),
    (["x", "--zzz", "3"], "error: cmd: unknown flag --zzz; see cmd --help"),
    (["--text", "y"], "error: cmd: missing required flag(s) --name; see cmd --help"),
    (["x", "--text"], "error: cmd: --text needs a value (str)"),
    (["x", "y"], "error: cmd: unexpected argument(s) ['y']; see cmd --help"),
    (["x", "--n", "1", "--n", "2"], "error: cmd: --n is given twice"),
    (["x", "--noflag=true"], "error: cmd: --noflag=true takes no value; write --flag false"),
])
def test_bad_flags_are_refused_before_the_command_runs(capfd, argv, message):
    calls: list = []
    if message is None:  # nan is a float; nothing bounds --x
        run(command_recording(calls), argv, prog="cmd")
        assert math.isnan(calls[0]["x"])
        return
    with pytest.raises(SystemExit) as e:
        run(command_recording(calls), argv, prog="cmd")
    assert e.value.code == 2 and calls == []
    assert capfd.readouterr().err == message + "\n"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_of_every_command_lists_each_flag_with_type_default_and_meaning(capsys, name):
    run(COMMANDS, [name, "--help"], prog="pmx-runner")
    out = capsys.readouterr().out
    for f in flags_of(COMMANDS[name]):
        line = next((ln for ln in out.splitlines() if ln.strip().startswith(f"--{f.name} ")), None)
        assert line is not None, f"--{f.name} missing from {name} --help:\n{out}"
        assert f.type_text() in line and f.default_text() in line and len(line.split("  ")[-1].strip()) > 3, line
    assert "NAME" not in out and "Optional[" not in out


def test_help_of_the_scripts():
    for script, needle in (("Demo.py", "--max_gen_len int >= 1              default 256    new tokens per sequence"),
                           ("Split.py", "--num_shards int"),
                           ("benchmark.sh", "MIN_PROFILING_SECONDS"), ("benchmark_llama.sh", "BATCH_SIZES")):
        cmd = [sys.executable, SCRIPTS / script] if script.endswith(".py") else [SCRIPTS / script]
        res = subprocess.run([str(c) for c in cmd + ["--help"]], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and needle in res.stdout, (script, res.stdout + res.stderr)


def test_commands_list_and_unknown_command(capfd):
    run(COMMANDS, ["--help"], prog="pmx-runner")
    out = capfd.readouterr().out
    assert all(f"  {name}" in out for name in COMMANDS)
    with pytest.raises(SystemExit):
        run(COMMANDS, ["splt"], prog="pmx-runner")
    assert "unknown command 'splt'; did you mean split?" in capfd.readouterr().err


def test_compare_threshold_must_be_a_number(tmp_path, capfd):
    with pytest.raises(SystemExit) as e:
        main(["compare", str(tmp_path), str(tmp_path), "--threshold", "abc"])
    assert e.value.code == 2 and capfd.readouterr().err == "error: --threshold must be a number, got 'abc'\n"


def test_generate_takes_the_prompt_as_typed(stories, capfd):
    for prompt in ("Hello, world", "None"):
        main(["generate", "--ckpt_dir", str(stories / "pmx"), "--prompt", prompt, "--max_gen_len", "2",
              "--progress", "false"])
        out = capfd.readouterr().out.splitlines()
        assert out[0] == "prepared 1 prompts" and out[1].startswith(prompt) and len(out[1]) > len(prompt), out
