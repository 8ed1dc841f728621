"""``[metrics]``: TensorBoard and W&B receive each step's record; a missing package or a
bad value is a one-line error naming the flag (no processes: the writers are rank 0's)."""

import os
import sys

import pytest

from fullshard.cli import train as train_cli
from fullshard.train.config.schema import get_preset
from fullshard.train.config.flags import apply_overrides
from fullshard.train.report.dashboards import TensorBoard, WandB, scalars
from fullshard.train.config.packages import check_packages
from support.train_runs import tensorboard_scalars

RECORDS = [{"step": 0, "val_loss": 4.2},
           {"step": 1, "loss": 4.1, "lr": 1e-3, "peak_mem_bytes": 123456789,
            "peak_mem_bytes_per_rank": [123456789, 12], "grad_norm": 0.5},
           {"step": 2, "loss": 3.9, "lr": 2e-3, "peak_mem_bytes": 123456790,
            "peak_mem_bytes_per_rank": [123456790, 12], "grad_norm": 0.4, "val_loss": 3.8}]


def test_tensorboard_event_files_hold_every_record_and_a_resume_drops_the_lost_steps(
        tmp_path):
    pytest.importorskip("tensorboard")
    board = TensorBoard(str(tmp_path), resume_step=None)
    for record in RECORDS:
        board.write(record)
    board.close()
    got = tensorboard_scalars(str(tmp_path))
    assert set(got) == {"val_loss", "loss", "lr", "peak_mem_bytes", "grad_norm"}
    assert got["loss"] == [(1, pytest.approx(4.1)), (2, pytest.approx(3.9))]
    assert got["val_loss"] == [(0, pytest.approx(4.2)), (2, pytest.approx(3.8))]
    assert got["peak_mem_bytes"][0] == (1, pytest.approx(123456789, rel=1e-6))
    # Resumed from the checkpoint of step 1: the old run's step 2 is purged, the new kept.
    board = TensorBoard(str(tmp_path), resume_step=1)
    board.write({"step": 2, "loss": 3.5})
    board.close()
    assert tensorboard_scalars(str(tmp_path))["loss"] == [(1, pytest.approx(4.1)),
                                                           (2, pytest.approx(3.5))]


def test_scalars_leave_out_the_step_lists_and_flags():
    assert scalars({"step": 3, "loss": 1.0, "per_rank": [1, 2], "ok": True, "n": 2}) == \
        {"loss": 1.0, "n": 2}


def test_wandb_offline_run_logs_every_record_and_resume_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = apply_overrides(get_preset("debug"), {"metrics.wandb": "fullshard-test"}, "test")
    first = WandB(cfg, str(tmp_path), resume_step=None)
    for record in RECORDS:
        first.write(record)
    run_id = first.run.id
    # W&B commits a step when the next one is logged: steps 0 and 1 are in.
    assert first.run.summary["loss"] == pytest.approx(4.1)
    assert first.run.summary["val_loss"] == pytest.approx(4.2)
    first.close()
    assert (tmp_path / "wandb_run_id").read_text() == run_id
    assert any(name.startswith("offline-run-") and name.endswith(run_id)
               for name in os.listdir(tmp_path / "wandb"))
    again = WandB(cfg, str(tmp_path), resume_step=2)
    assert again.run.id == run_id
    again.close()


@pytest.mark.parametrize("flag, value, module, extra", [
    ("--metrics.tensorboard", "true", "tensorboard", "tensorboard"),
    ("--metrics.wandb", "my-project", "wandb", "wandb"),
])
def test_a_missing_package_is_named_with_its_extra_before_launching(
        flag, value, module, extra, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # what import sees when not installed
    assert train_cli.main(["--preset", "debug", "--out", str(tmp_path), flag, value]) == 2
    err = capsys.readouterr().err
    field = flag.removeprefix("--")
    assert err == (f"fullshard train: {field}: needs the {module} package, which is not "
                   f"installed; install it with pip install 'fullshard[{extra}]'\n")


def test_the_trainer_checks_packages_on_every_rank_too(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    cfg = apply_overrides(get_preset("debug"), {"metrics.tensorboard": True}, "test")
    with pytest.raises(Exception, match=r"metrics.tensorboard: needs the tensorboard"):
        check_packages(cfg)
    assert check_packages(get_preset("debug")) is not None  # nothing asked, nothing needed


@pytest.mark.parametrize("flags, message", [
    (["--metrics.tensorboard", "maybe"], "metrics.tensorboard: expected true/false, got "
                                         "'maybe'"),
    (["--metrics.wandb", "team/project"], "metrics.wandb: a W&B project name of at most 128 "
                                          "characters, without any of / \\ # ? % :; got "
                                          "'team/project'"),
    (["--metrics.wandb", "x" * 129], "metrics.wandb: a W&B project name of at most 128"),
])
def test_bad_metrics_values_are_one_line_errors(flags, message, capsys, tmp_path):
    assert train_cli.main(["--preset", "debug", "--out", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
