"""How a worker of ``fullshard train`` ends: what Python's exit does first, then no
finalization (Note [a worker's process ends without the interpreter's finalization] in
train/launch/launcher.py)."""

import subprocess
import sys
import textwrap

from faults.sitecustomize import PROBE_EXIT, environment
from support.train_runs import ENV, checkpoints, fullshard_train_preset, metrics


def test_a_worker_runs_its_exit_handlers_and_is_never_finalized(tmp_path):
    probe, out = tmp_path / "probe", str(tmp_path / "run")
    probe.mkdir()
    run = fullshard_train_preset(out, "debug", {"steps": 2, "checkpoint.every": 2,
                                                "eval.every": 0, "eval.sample_tokens": 0},
                                 env=environment(PROBE_EXIT, probe))
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        assert (probe / f"rank{rank}.atexit").read_text() == "atexit"
        assert (probe / f"rank{rank}.finalized").read_text() == ""
    # What the workers wrote is whole.
    assert [r["step"] for r in metrics(out)] == [0, 1, 2]
    assert checkpoints(out) == ("step_000002", ["step_000002"])


def test_the_end_waits_for_threads_and_executors_runs_atexit_and_keeps_the_exit_code(tmp_path):
    done, pooled, said = tmp_path / "thread", tmp_path / "pooled", tmp_path / "atexit"
    program = textwrap.dedent(f"""
        import atexit, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from fullshard.train.launch import launcher
        def slow(path):
            time.sleep(0.5)
            open(path, "w").write("done")
        threading.Thread(target=slow, args=({str(done)!r},)).start()
        never_shut_down = ThreadPoolExecutor(max_workers=1)  # its thread waits for work
        never_shut_down.submit(slow, {str(pooled)!r})
        atexit.register(lambda: open({str(said)!r}, "w").write("said"))
        print("unflushed", end="")
        launcher.end_worker_process(5)
        """)
    ended = subprocess.run([sys.executable, "-c", program], env=ENV, capture_output=True,
                           text=True, timeout=60)
    assert ended.returncode == 5, ended.stderr[-3000:]
    assert ended.stdout == "unflushed"
    assert done.read_text() == pooled.read_text() == "done"
    assert said.read_text() == "said"
