"""``fullshard project`` and ``fullshard plan --gpus`` on the command line: shapes from
presets, Hugging Face configs and flags, accumulation, reduce dtype, and one-line errors."""

from __future__ import annotations

import json

import pytest

from fullshard.cli import main
from fullshard.projection import DEVICES, SHAPES, Cluster, rank_configurations, shape_named

from support.catalogue import matches_documented


# -- command line ---------------------------------------------------------------------------
def test_project_prints_each_strategy_and_world_size(capsys):
    assert main(["project", "--model", "llama3-8b", "--gpus", "8,128", "--batch", "2",
                 "--seq", "8192", "--ac", "selective"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith(("8 ", "128 "))]
    assert len(rows) == 3 + 4  # hybrid_shard needs more than one node
    assert "llama3-8b (8,030.3M parameters) on h100," in out


def test_every_projection_prints_its_range_and_what_dominates_it(capsys):
    # the range: where the validation's runs from unseen sources fell; it brackets the
    # point estimate. A tiny model at 1,024 GPUs waits on its gathers
    from fullshard.projection.validation import error_band

    band = error_band()
    assert main(["project", "--layers", "4", "--dim", "256", "--heads", "4", "--kv-heads", "4",
                 "--ffn", "1024", "--vocab", "32000", "--gpus", "1,1024", "--batch", "1",
                 "--seq", "2048", "--strategy", "full_shard"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("1 ", "1024 "))]
    assert len(rows) == 2
    for row in rows:
        step, (low, high) = float(row[6]), map(float, row[7].split("-"))
        tokens = float(row[8].replace(",", ""))
        t_low, t_high = (float(v.replace(",", "")) for v in row[9].split("-"))
        assert low <= step <= high and t_low <= tokens <= t_high
        assert (t_low, t_high) == pytest.approx(band.tokens_per_second(tokens), rel=1e-3)
    assert " ".join(rows[1][13:]) == "exposed all-gather"
    assert f"within {band.error:.1%}" in out and "left out of the fit" in out


def test_gpus_per_node_decides_which_gathers_cross_nodes(capsys):
    # 8 GPUs in two nodes of 4: the gathers cross the NICs (4 per node, not 8, carry
    # them), so more communication is exposed than inside one node of 8
    base = ["project", "--model", "llama3-8b", "--gpus", "8", "--batch", "1", "--seq",
            "2048", "--strategy", "full_shard"]
    rows = {}
    for flags in (["--gpus-per-node", "4"], ["--gpus-per-node", "8"], ["--nodes-of", "4"]):
        assert main(base + flags) == 0
        rows[tuple(flags)] = capsys.readouterr().out.splitlines()[-2].split()
    four, eight = rows[("--gpus-per-node", "4")], rows[("--gpus-per-node", "8")]
    assert float(four[-3]) > 2 * float(eight[-3])  # exposed communication, seconds
    assert float(four[6]) > float(eight[6])  # step time
    assert rows[("--nodes-of", "4")] == four  # the older spelling means the same


def test_plan_ranks_by_throughput_prints_flags_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "plan.png"
    assert main(["plan", "--gpus", "64", "--gpu", "h100", "--nodes-of", "8", "--model",
                 "llama3-8b", "--batch", "4", "--seq", "4096", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    flags = [line for line in out.splitlines() if line.startswith("fullshard train")]
    assert len(flags) == 1 and "--nnodes 8" in flags[0] and "--nproc 8" in flags[0]
    assert plot.stat().st_size > 10_000


def test_plan_says_when_nothing_fits(capsys):
    assert main(["plan", "--gpus", "8", "--model", "llama3-70b", "--memory-gib", "8",
                 "--plot", ""]) == 1
    assert "nothing fits" in capsys.readouterr().out


# Hugging Face config.json files as their hubs publish them (the fields a projection reads)
LLAMA31_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
              "vocab_size": 128256, "tie_word_embeddings": False, "head_dim": 128}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
        "n_positions": 1024, "vocab_size": 50257}
MIXTRAL = {**LLAMA31_8B, "model_type": "mixtral", "num_local_experts": 8}  # no top-k
DEEPSEEK = {**LLAMA31_8B, "model_type": "deepseek_v3", "n_routed_experts": 256,
            "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3}


def _config(tmp_path, name: str, fields: dict) -> str:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return str(folder)


def test_project_reads_a_hugging_face_config_and_shape_flags(tmp_path, capsys):
    llama = _config(tmp_path, "llama31", LLAMA31_8B)
    assert main(["project", "--model", llama, "--gpus", "8", "--strategy", "full_shard"]) == 0
    from_config = capsys.readouterr().out
    assert "llama31 (8,030.3M parameters)" in from_config
    assert main(["project", "--layers", "32", "--dim", "4096", "--heads", "32",
                 "--kv-heads", "8", "--ffn", "14336", "--vocab", "128256", "--gpus", "8",
                 "--strategy", "full_shard"]) == 0
    by_hand = capsys.readouterr().out
    assert by_hand.splitlines()[1:] == from_config.splitlines()[1:]  # the same numbers
    gpt2 = _config(tmp_path, "gpt2", GPT2)
    assert main(["project", "--model", gpt2, "--seq", "1024", "--gpus", "8"]) == 0
    assert "gpt2 (124.3M parameters)" in capsys.readouterr().out  # biases not counted


def test_project_takes_the_attention_kernel_and_a_first_generation_one_is_slower(capsys):
    base = ["project", "--model", "llama2-7b", "--gpus", "8", "--strategy", "full_shard",
            "--batch", "1", "--seq", "32768"]
    steps = []
    for kernel in ("flash2", "flash1"):
        assert main(base + ["--attention", kernel]) == 0
        steps.append(float(capsys.readouterr().out.splitlines()[-2].split()[6]))
    # at 32k tokens attention is much of the step (over a third), and only it slows: the
    # step grows by less than the whole step would at the first generation's rate
    from fullshard.projection import FITTED

    assert 1.1 * steps[0] < steps[1] < steps[0] / FITTED.flash1


def test_project_splits_the_batch_and_reduces_in_bf16_when_asked(capsys):
    base = ["project", "--gpus", "8", "--strategy", "full_shard", "--reduce-dtype", "bf16"]
    assert main(base + ["--batch", "2"]) == 0
    micro = capsys.readouterr().out.splitlines()[-2].split()  # the last: what ranges mean
    assert main(base + ["--batch", "8", "--grad-accum", "4"]) == 0
    split = capsys.readouterr().out.splitlines()[-2].split()
    assert (micro[4], micro[5]) == ("2", "1") and (split[4], split[5]) == ("2", "4")
    # the same micro-batch, plus a bf16 accumulator for each of the 8.03B parameters
    assert float(split[12]) - float(micro[12]) == pytest.approx(2 * 8.03e9 / 2**30, abs=0.2)


def test_plan_never_recommends_what_the_trainer_cannot_run(tmp_path, capsys):
    # a sequence beyond the preset's position table is refused (E185), not recommended
    assert main(["plan", "--gpus", "8", "--model", "gpt2-124m", "--seq", "2048",
                 "--plot", ""]) == 2
    assert "exceeds the 1024 positions" in capsys.readouterr().err
    # micro-batches divide the batch (accumulation reaches exactly the batch asked for)
    fits, _ = rank_configurations(SHAPES["llama2-7b"], Cluster(DEVICES["h100"], 64, 8),
                                  batch=6, seq=4096)
    assert {p.settings.batch for p in fits} == {1, 2, 3, 6}
    assert all(p.settings.batch * p.settings.grad_accum == 6 for p in fits)
    # a config.json: the flags train that folder
    llama = _config(tmp_path, "llama31", LLAMA31_8B)
    assert main(["plan", "--gpus", "16", "--model", llama, "--batch", "2", "--seq", "4096",
                 "--plot", ""]) == 0
    flags = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("fullshard train")]
    assert flags and f"--model hf:{llama} " in flags[0]


@pytest.mark.parametrize("argv,code", [
    (["project", "--gpu", "x100"], "E125"),
    (["project", "--gpus", "12", "--nodes-of", "8"], "E126"),
    (["project", "--model", "gpt5"], "E128"),
    (["project", "--gpus", "8", "--strategy", "hybrid_shard"], "E129"),
    (["project", "--model", "gpt2-124m", "--seq", "2048"], "E185"),
    (["project", "--batch", "6", "--grad-accum", "4"], "E186"),
    (["project", "--model", "{gpt2_no_layers}"], "E187"),
    (["project", "--heads", "24", "--kv-heads", "16"], "E188"),
    (["project", "--model", "{deepseek}"], "E189"),
    (["project", "--model", "{mixtral}"], "E213"),
    (["project", "--model", "llama3-8b", "--ep", "2"], "E226"),
    (["project", "--model", "moe", "--ep", "3"], "E227"),
    (["project", "--model", "moe", "--gpus", "8", "--ep", "2", "--strategy", "no_shard"],
     "E227"),
    (["project", "--ac-every", "2"], "E242"),
    (["project", "--ac", "selective", "--ac-every", "3"], "E242"),
    (["project", "--gpu", "b200"], "E393"),
    (["plan", "--gpus", "64", "--gpu", "mi300x", "--plot", ""], "E393"),
])
def test_bad_input_is_one_line_naming_it(argv, code, capsys, tmp_path):
    paths = {"gpt2_no_layers": _config(tmp_path, "gpt2", {k: v for k, v in GPT2.items()
                                                          if k != "n_layer"}),
             "mixtral": _config(tmp_path, "mixtral", MIXTRAL),
             "deepseek": _config(tmp_path, "deepseek", DEEPSEEK)}
    argv = [a.format(**paths) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert matches_documented(code, "ProjectionError: " + err.split(": ", 1)[1]), err


@pytest.mark.parametrize("argv,flag", [
    (["project", "--batch", "0"], "--batch"),
    (["project", "--gpus", "0"], "--gpus"),
    (["project", "--gpus", "8,x"], "--gpus"),
    (["project", "--seq", "nan"], "--seq"),
    (["plan", "--gpus", "64", "--efficiency", "-1"], "--efficiency"),
    (["plan", "--gpus", "64", "--efficiency", "1.5"], "--efficiency"),
    (["plan", "--gpus", "64", "--inter-gbps", "inf"], "--inter-gbps"),
    (["plan", "--gpus", "64", "--nodes-of", "0"], "--nodes-of"),
    (["plan", "--gpus", "64", "--gpus-per-node", "0"], "--gpus-per-node"),
])
def test_bad_numbers_are_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        code = main(argv)
        raise SystemExit(code)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, code", [
    (["plan", "--gpus", "8", "--model", "debug", "--seq", "100000", "--plot", ""], "E185"),
    (["project", "--model", "debug", "--seq", "33"], "E185"),
    (["project", "--calibrate", "--preset", "debug", "--gpus", "1", "--seq", "4096"], "E81"),
])
def test_a_sequence_longer_than_a_preset_model_is_refused_before_anything_runs(argv, code,
                                                                             capsys):
    """What the trainer would refuse (--batch.seq-len beyond the GPT's positions) is
    neither planned nor timed: one line, before calibration starts a process."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    kind = "ConfigError" if code == "E81" else "ProjectionError"
    assert matches_documented(code, f"{kind}: " + err.split(": ", 1)[1]), err


def test_a_preset_model_projects_within_its_positions_by_default(capsys):
    """The default --seq (4096) becomes a preset GPT's positions; with --calibrate, the
    length the preset trains with."""
    from fullshard.cli.project import _sequence
    from fullshard.projection import shape_of
    from fullshard.train.config.schema import get_preset

    assert main(["plan", "--gpus", "8", "--model", "debug", "--plot", ""]) == 0
    flags = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("fullshard train")]
    assert "--batch.seq_len 32" in flags[0], flags
    debug = get_preset("debug")
    assert _sequence(None, shape_of(debug.gpt, "debug"), debug.batch.seq_len) == 32
    assert _sequence(None, shape_named("llama3-8b")) == 4096


def test_project_takes_compile_and_a_compiled_run_is_faster_within_the_terms_bounds(capsys):
    # torchtitan's Llama 3.1 8B on 8 H100s: compiled, the step loses part of its
    # elementwise time and launches (Note [what compilation saves]), never more than
    # compile_saving of the eager step's compute outside matrix multiplies and attention
    from dataclasses import replace

    from fullshard.projection import FITTED, Settings, project

    base = ["project", "--model", "llama3-8b", "--gpus", "8", "--strategy", "full_shard",
            "--batch", "2", "--seq", "8192", "--ac", "selective"]
    steps = {}
    for compile_ in ("none", "blocks", "model"):
        assert main(base + ["--compile", compile_]) == 0
        steps[compile_] = float(capsys.readouterr().out.splitlines()[-2].split()[6])
    assert steps["model"] <= steps["blocks"] < steps["none"]
    cluster = Cluster(DEVICES["h100"], 8, 8)
    run = Settings("full_shard", 2, 8192, checkpointing="selective")
    eager = project(SHAPES["llama3-8b"], cluster, run).time.seconds
    # the eager step with nothing left to fuse: its elementwise work and launches removed
    bare = replace(FITTED, elementwise={k: 0.0 for k in FITTED.elementwise},
                   unit_overhead=0.0)
    fusable = eager - project(SHAPES["llama3-8b"], cluster, run, bare).time.seconds
    saved = steps["none"] - steps["blocks"]
    assert 0.5 * FITTED.compile_saving * fusable < saved <= FITTED.compile_saving * fusable \
        + 1e-3  # the printed step is rounded to the millisecond
    # a setting that is not one is refused by argparse, naming the flag
    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(main(base + ["--compile", "inductor"]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--compile" in err and "Traceback" not in err, err


def test_project_takes_hand_fused_kernels_priced_as_compiled_blocks_and_saved_once(capsys):
    # Note [what compilation saves]: a run whose blocks call hand-written fused kernels
    # (TinyLlama's flash-attn RMSNorm and rotary, xformers' SwiGLU) saves what compiling
    # each block saves; compiled as well, it saves it once, not twice
    base = ["project", "--model", "llama3-8b", "--gpus", "8", "--strategy", "full_shard",
            "--batch", "2", "--seq", "8192"]
    steps = {}
    for extra in (["--kernels", "eager"], ["--kernels", "fused"], ["--compile", "blocks"],
                  ["--compile", "blocks", "--kernels", "fused"]):
        assert main(base + extra) == 0
        steps[" ".join(extra)] = float(capsys.readouterr().out.splitlines()[-2].split()[6])
    assert steps["--kernels fused"] == steps["--compile blocks"] \
        == steps["--compile blocks --kernels fused"] < steps["--kernels eager"]
    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(main(base + ["--kernels", "liger"]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--kernels" in err and "Traceback" not in err, err
