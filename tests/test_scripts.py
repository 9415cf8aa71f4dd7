"""The ppl.pmx-compatible scripts work with the ppl.pmx flags."""

from __future__ import annotations

import filecmp
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
