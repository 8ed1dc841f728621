"""`make gpu-check`'s script, end to end on CPU with tiny shapes (its --dry-run), so the
one command a GPU window runs cannot rot between windows."""

import pytest
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.extended
def test_the_gpu_check_runs_every_step_on_cpu(tmp_path):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "gpu-check.md").read_text()
    assert report.startswith("# fullshard gpu-check (DRY RUN")
    table = report.split("| step | status | seconds |\n|---|---|---:|\n")[1].split("\n\n")[0]
    rows = dict(line.split(" | ")[:2] for line in table.splitlines())
    assert set(rows) == {"| install", "| install-torchao", "| install-megatron", "| cuda-lane",
                         "| gpu-bench", "| trainer", "| trainer-compiled", "| memory",
                         "| checkpoint"}
    assert rows["| gpu-bench"] == rows["| trainer"] == rows["| memory"] == "ok"
    assert rows["| checkpoint"] == "ok" and "| load (verify, read, reshard) |" in report
    assert rows["| cuda-lane"].startswith("skipped: pytest ran no test")
    assert "the CUDA lane needs a CUDA GPU" in report
    bench = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert set(bench) == {"G1/plain", "G1/fullshard", "G3/fullshard", "G3/fullshard-resident"}
    # the same model and batches (bf16 autocast against bf16 parameters: close, not equal)
    assert abs(bench["G1/plain"]["losses"][0] - bench["G1/fullshard"]["losses"][0]) < 0.05
    assert "trainer / plain tokens/s" in report and "memory: estimated" in report
    cases = [r["case"] for r in json.loads((tmp_path / "gpu-memory.json").read_text())]
    assert cases[0] == "plain" and set(cases) <= {"plain", "qlora", "float8"}
    assert (tmp_path / "gpu-check.log").stat().st_size > 0
