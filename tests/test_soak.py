"""The 60-second soak (benchmarks/soak.py) on two ranks: valid traffic beside fuzzed requests, slow clients and
disconnect storms, then a SIGTERM drain. It asserts no 5xx, every request answered within 30 s, greedy outputs
identical throughout, flat memory / open files / threads, /metrics drained, a clean stop with nothing left behind;
its JSON is checked here too, so that a soak that checked nothing cannot pass."""

from __future__ import annotations

import json
import sys

from jobs import ROOT, Job


def test_soak_60_seconds_on_two_ranks(tmp_path):
    from conftest import shared_model_path
    model = shared_model_path("stories260k")
    out = tmp_path / "soak.json"
    with Job([sys.executable, ROOT / "benchmarks" / "soak.py", "--seconds", 60, "--ranks", 2, "--clients", 16,
              "--model", model, "--workdir", tmp_path / "work", "--json_path", out], tmp_path) as job:
        rc = job.wait(420)
        assert rc == 0, job.stdout[-4000:] + job.stderr[-2000:]
        assert not job.lingering()
    r = json.loads(out.read_text())
    assert r["failures"] == [] and all(r["checks"].values()), r["checks"]
    counts = r["counts"]
    assert counts.get("valid 200", 0) > 50 and counts.get("fuzz 400", 0) > 20 and counts.get("slow 408", 0) > 10
    assert sum(v for k, v in counts.items() if k.startswith("disconnect")) > 10
    assert not any(int(k.split()[1]) >= 500 for k in counts if k.split()[1].isdigit())
    assert r["greedy_cases"] >= 10 and r["mismatches"] == 0 and r["unanswered"] == 0
    assert set(r["resources"]) == {"rank 0", "rank 1", "front end"}
    assert r["drain"]["exit_status"] == 0 and r["drain"]["left_behind"] == []
    assert r["server_metrics"]["requests_running"] == 0 and r["server_metrics"]["kv_pages_used"] == 0
    assert r["server_metrics"]["preemptions_total"] > 0  # (the 4-page cache made them)
