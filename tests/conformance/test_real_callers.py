"""Code nobody here wrote, unchanged, on fullshard through the explicit opt-in.

Lightning's ``ModelParallelStrategy`` (``configure_model`` shards with torch's names,
the strategy steps with ``optimizer.step(closure)``) trains as single-process training
on the same batches and as with torch's FSDP2.

transformers' own FSDP2 path (``from_pretrained(..., distributed_config=...)``, which
imports ``fully_shard`` from ``torch.distributed._composable.fsdp``, shards a list of
modules, checks ``isinstance(m, FSDPModule)``) trains with fullshard after
``fullshard.install()`` to the same losses as with torch's FSDP2.

accelerate's ``fsdp2_prepare_model`` (its auto-wrap policy per decoder layer, the
embedding alone, the ``[norm, embedding, lm_head]`` tail of a tied model as one unit, the
root with torch's default) shards with fullshard after ``fullshard.install()`` into the
units torch's FSDP2 gets, and trains to the same losses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fullshard.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it for distributed loading


def _tiny_llama(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def _train_with_transformers(path: str, use_fullshard: bool):
    import fullshard

    if use_fullshard:
        fullshard.install()
    try:
        from torch.distributed.fsdp import FSDPModule
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(fsdp_size=2))
        units = sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return units, isinstance(model, fullshard.FSDPModule), losses
    finally:
        fullshard.uninstall()


@pytest.mark.slow
def test_transformers_fsdp2_path_runs_on_fullshard_unchanged(tmp_path):
    _tiny_llama(str(tmp_path))
    ours = run_distributed(_train_with_transformers, 2, str(tmp_path), True, timeout=300)[0]
    theirs = run_distributed(_train_with_transformers, 2, str(tmp_path), False, timeout=300)[0]
    units, is_fullshard, losses = ours
    assert is_fullshard and not theirs[1]
    assert units == theirs[0]  # the same units: embedding, decoder layers, [norm, lm_head], root
    assert "FSDPLlamaDecoderLayer" in units
    assert losses == pytest.approx(theirs[2], rel=1e-5)


def _train_with_accelerate(tied: bool, use_fullshard: bool):
    """accelerate's own FSDP2 preparation, unchanged. ``Accelerator`` itself takes its FSDP
    path only on GPUs, so the function is handed what it reads of one: the FSDP plugin
    (built by accelerate), the mixed precision and the device."""
    import types

    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import fullshard

    if use_fullshard:
        fullshard.install()
    try:
        from torch.distributed.fsdp import FSDPModule

        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=32, tie_word_embeddings=tied)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True)
        accelerator = types.SimpleNamespace(
            state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
            is_main_process=dist.get_rank() == 0, device=torch.device("cpu"))
        model = fsdp2_prepare_model(accelerator, model)
        units = sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x = torch.randint(0, 64, (2, 16),
                              generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return units, isinstance(model, fullshard.FSDPModule), losses
    finally:
        fullshard.uninstall()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.slow
def test_accelerate_fsdp2_prepare_model_runs_on_fullshard_unchanged(tied):
    ours = run_distributed(_train_with_accelerate, 2, tied, True, timeout=300)
    theirs = run_distributed(_train_with_accelerate, 2, tied, False, timeout=300)
    assert ours[0][1] and not theirs[0][1]
    assert ours[0][0] == theirs[0][0]  # the same modules sharded, the tail's among them
    for mine, torchs in zip(ours, theirs):  # each rank's losses
        assert mine[2] == pytest.approx(torchs[2], rel=1e-5)


def test_install_and_uninstall_swap_torchs_names():
    import torch.distributed._composable.fsdp as composable
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp._fully_shard import _fully_shard as defining  # torch's tests

    import fullshard

    original = torch_fsdp.fully_shard
    fullshard.install()
    try:
        assert torch_fsdp.fully_shard is fullshard.fully_shard
        assert composable.fully_shard is fullshard.fully_shard
        assert torch_fsdp.FSDPModule is fullshard.FSDPModule
        assert defining.FSDPModule is fullshard.FSDPModule
        assert torch_fsdp.MixedPrecisionPolicy is not fullshard.MixedPrecisionPolicy  # torch's
    finally:
        fullshard.uninstall()
    assert torch_fsdp.fully_shard is original
    assert defining.FSDPModule is not fullshard.FSDPModule


@pytest.mark.slow
def test_run_module_installs_before_the_program_imports_torchs_names(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch.distributed as dist
        import torch.nn as nn
        from torch.distributed.fsdp import FSDPModule, fully_shard
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = fully_shard(nn.Linear(4, 4))
        print(fully_shard.__module__, isinstance(model, FSDPModule), sys.argv[1:])
        dist.destroy_process_group()
    """))
    out = subprocess.run([sys.executable, "-m", "fullshard.run", str(script), "--flag", "x"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fullshard.api", "True", "['--flag',", "'x']"]


# -- Lightning ---------------------------------------------------------------------------------
def _lightning(impl: str, out) -> list[dict]:
    import json

    script = os.path.join(os.path.dirname(__file__), "callers", "lightning_model_parallel.py")
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, script, impl, str(out)], env=env, cwd=out,
                          capture_output=True, text=True, timeout=300)
    # torch's own run can abort at interpreter exit, after its results are written: a gloo
    # worker thread dropping a collective's tensors takes the GIL while the interpreter
    # finalizes (Note [collectives settle before exit] in core/comm.py, which fullshard's
    # run waits out). The reference's results stand; fullshard's run must exit cleanly.
    exit_race = (impl == "torch" and done.returncode == -6
                 and "terminate called without an active exception" in done.stderr)
    assert done.returncode == 0 or exit_race, done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _lightning_reference(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Single-process training on the union of the ranks' batches, step by step."""
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                        nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(len(ranks[0]["batches"])):
        losses = [F.mse_loss(net(torch.tensor(r["batches"][step][0])),
                             torch.tensor(r["batches"][step][1])) for r in ranks]
        (sum(losses) / len(losses)).backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


@pytest.mark.extended
def test_lightning_model_parallel_strategy_trains_as_single_process(tmp_path):
    # Lightning steps with optimizer.step(closure): forward and backward run inside step()
    pytest.importorskip("lightning")
    ours = _lightning("fullshard", tmp_path / "fullshard")
    theirs = _lightning("torch", tmp_path / "torch")
    assert ours[0]["kinds"] == ["fullshard.api"] and theirs[0]["kinds"] != ours[0]["kinds"]
    for a, b in zip(ours, theirs):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
    for key, ref in _lightning_reference(ours).items():
        torch.testing.assert_close(torch.tensor(ours[0]["weights"][key]), ref, msg=key)
