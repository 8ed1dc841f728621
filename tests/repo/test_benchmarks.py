"""The GPU benchmark's own logic, run on CPU with tiny shapes (the figures are measured
on a GPU; here only that every implementation trains the same model and the table is
built)."""

import pytest
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench(script: str, *args: str, timeout: float = 300,
           one_thread: bool = False) -> subprocess.CompletedProcess:
    """Run ``benchmarks/SCRIPT ARGS`` to completion; fails the test unless it exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if one_thread else None
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.mark.extended
def test_gpu_benchmark_runs_each_implementation_to_the_same_losses(tmp_path):
    out = tmp_path / "results.json"
    proc = _bench("gpu.py", "--tiny", "--device", "cpu", "--workloads", "G1,G3",
                  "--impls", "fsdp2,fullshard,megatron", "--json", str(out))
    results = json.loads(out.read_text())
    assert set(results) == {"G1/fsdp2", "G1/fullshard", "G3/fsdp2", "G3/fullshard"}
    reference = results["G1/fsdp2"]["losses"]
    assert reference, "the benchmark recorded no losses"
    for name, r in results.items():
        assert len(r["losses"]) == len(reference), name
        assert all(abs(a - b) < 1e-4 for a, b in zip(r["losses"], reference)), name
        assert set(r["phases_ms"]) == {"forward", "backward", "clip", "optimizer"}
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0
    assert "| G3 | fullshard |" in proc.stdout
    # Megatron-FSDP needs CUDA (and may not be installed): skipped with its reason
    assert "megatron on G1: skipped (" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.extended
def test_gpu_benchmark_captured_step_reaches_capture_step_and_only_the_device_is_refused():
    """fullshard-graph is skipped on CPU by the driver; its worker, run here on CPU, hands
    capture_step a model, a capturable optimizer and inputs it accepts, and is refused
    for the device alone (docs/errors.md E373): what a GPU session would capture."""
    from fullshard.testing import free_port
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
         f"--master_port={free_port()}", str(ROOT / "benchmarks" / "gpu.py"), "--worker",
         "--impl", "fullshard-graph", "--workload", "G2", "--tiny"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "BENCH_DEVICE": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert ("CaptureError: fullshard.capture_step: FSDPLlama computes on cpu: a CUDA graph "
            "captures CUDA work only" in proc.stderr), proc.stderr[-2000:]
    skipped = _bench("gpu.py", "--tiny", "--device", "cpu", "--workloads", "G2",
                     "--impls", "fullshard-graph")
    assert "fullshard-graph on G2: skipped (a CUDA graph needs CUDA)" in skipped.stderr


@pytest.mark.slow
def test_trainer_benchmark_times_the_trainer_beside_a_plain_loop():
    proc = _bench("trainer.py", "--preset", "debug", "--rounds", "1", "--block", "2")
    assert "| fullshard train |" in proc.stdout and "trainer / plain tokens/s:" in proc.stdout


@pytest.mark.extended
def test_disk_offload_benchmark_reports_time_throughput_and_memory(tmp_path):
    proc = _bench("disk_offload.py", "--tiny", "--steps", "2", "--memory-steps", "1",
                  "--dir", str(tmp_path), "--parts", "time,overlap,fraction,memory",
                  "--block", "1")
    for line in ("disk / CPU       step", "fullshard I/O thread (rank 0):",
                 "dd direct I/O, one process: write", "rank 1: CPU offload",
                 "states on disk  in optimizer.step", "the last blocks offloaded",
                 "    0.75 "):
        assert line in proc.stdout, proc.stdout
    assert list(tmp_path.iterdir()) == []  # state folders and the dd probe removed


@pytest.mark.extended
def test_quantized_comm_benchmark_counts_bytes_per_setting():
    proc = _bench("quantized_comm.py", "--tiny", "--steps", "2")
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines()
            if line.startswith("| ") and "MB/step" not in line}
    assert set(rows) == {"none", "weights", "grads", "weights,grads"}, proc.stdout
    ratios = {name: [float(c) for c in row.split("|")[3:6:2]] for name, row in rows.items()}
    assert ratios["none"] == [1.0, 1.0]
    assert ratios["weights"][0] < 0.3 and ratios["grads"][1] < 0.3  # fp32 -> int8 + scales


@pytest.mark.extended
def test_hf_import_benchmark_times_each_import_and_the_memory_per_rank():
    proc = _bench("hf_import.py", "--world-size", "2", "--repeats", "1", "--layers", "2",
                  "--hidden", "256", timeout=400, one_thread=True)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:]
            for line in proc.stdout.splitlines() if line.startswith("| ")}
    for op in ("read once", "load_hf", "rank 0 + broadcast"):
        median, spread, ratio, round_ratio = (x.strip(" |") for x in rows[op])
        fastest, slowest = (float(x) for x in spread.split("-"))
        assert 0 < fastest <= float(median) <= slowest, (op, rows[op])
        assert float(ratio) > 0 and float(round_ratio) > 0, (op, rows[op])
    assert [x.strip(" |") for x in rows["read once"][2:]] == ["1.00", "1.00"]
    # both sides from the same page cache and fresh memory (the figures' conditions)
    assert "warm page cache, set before every side" in proc.stdout, proc.stdout
    assert "MALLOC_MMAP_THRESHOLD_=131072" in proc.stdout, proc.stdout
    for rank in ("0", "1"):  # each rank holds its shards (~36 MB of 72) and one tensor more
        shards, largest, rise = (float(x) for x in rows[rank][:3])
        assert 30 <= shards <= 40 and 0 < rise <= shards + largest, rows[rank]


@pytest.mark.scale
def test_scale_benchmark_prints_a_row_per_world_size_with_shards_summing_to_the_model():
    proc = _bench("scale.py", "--sizes", "8,64", "--rounds", "1", "--steps", "2",
                  one_thread=True)
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().replace(",", "").isdigit()]
    assert [r[0].strip() for r in rows] == ["8", "64"]
    assert rows[0][2] == rows[1][2]  # N x rank 0's shard bytes: the model, at both sizes


@pytest.mark.extended  # a benchmark run: make test's ten minutes are nearly spent
def test_overlapped_step_benchmark_steps_the_same_bits_as_stepping_first():
    proc = _bench("overlapped_step.py", "--shape", "tiny", "--rounds", "1", "--block", "3")
    assert "| fullshard, OverlappedStep |" in proc.stdout
    assert "step first vs OverlappedStep: 0" in proc.stdout, proc.stdout
    proc = _bench("overlapped_step.py", "--shape", "tiny", "--rounds", "1", "--block", "3",
                  "--no-clip")
    assert "| fullshard, OverlappedStep stepping in backward |" in proc.stdout, proc.stdout
    assert "step first vs OverlappedStep: 0" in proc.stdout, proc.stdout
    assert "| fullshard, OverlappedStep(delayed=True) |" in proc.stdout, proc.stdout
    assert "step first vs delayed (one step stale): " in proc.stdout, proc.stdout


@pytest.mark.extended  # a benchmark run: make test's ten minutes are nearly spent
def test_step_hooks_benchmark_times_both_steps_and_their_difference():
    proc = _bench("step_hooks.py", "--params", "20", "--steps", "3", one_thread=True)
    lines = proc.stdout.splitlines()
    times = [float(line.rsplit(":", 1)[1].split()[0]) for line in lines if line.endswith(" us")]
    assert len(times) == 3 and times[0] > 0 and times[1] > 0, proc.stdout
    assert abs(times[0] - times[1] - times[2]) <= 1, proc.stdout  # rounded to a microsecond


@pytest.mark.extended  # a benchmark run: make test's ten minutes are nearly spent
def test_unit_hooks_benchmark_prints_each_implementation_per_unit():
    proc = _bench("unit_hooks.py", "--units", "4", "--steps", "3", one_thread=True)
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| impl")}
    assert set(rows) == {"fullshard", "fsdp2", "plain"}, proc.stdout
    assert all(float(total) > 0 for total, _ in rows.values()), proc.stdout
    assert float(rows["plain"][1]) == 0.0, proc.stdout
