"""``fullshard.checkpoint.load_hf``: Hugging Face folders (and fullshard's own exports)
streamed into sharded models, each rank reading only its shards; against
``from_pretrained``'s weights exactly, at 1, 2 and 3 ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fullshard import fully_shard
from fullshard.checkpoint import CheckpointError, load_hf, parameters_on_meta
from fullshard.checkpoint.safetensors_files import SafetensorsFiles
from fullshard.testing import run_distributed
from fullshard.wrap import auto_wrap

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

_COMMON = dict(vocab_size=100, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def _configs() -> dict:
    """Llama (untied), Qwen2 (biases, tied embeddings; saved in bf16), Mixtral (experts
    transformers saves per expert and the model holds fused)."""
    return {"llama": transformers.LlamaConfig(**_COMMON),
            "qwen": transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
            "mixtral": transformers.MixtralConfig(**_COMMON, num_local_experts=3,
                                                  num_experts_per_tok=2)}


def _save_models(root: str) -> None:
    transformers.utils.logging.set_verbosity_error()
    for name, config in _configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        if name == "qwen":
            model = model.to(torch.bfloat16)
        model.save_pretrained(os.path.join(root, name), max_shard_size="20KB")


def _sharded(folder: str, on_meta: bool = True, **shard_kwargs):
    """The folder's model built from its config (parameters on the meta device), its
    decoder layers and then the root sharded."""
    config = transformers.AutoConfig.from_pretrained(folder)
    with parameters_on_meta() if on_meta else torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return auto_wrap(model, **shard_kwargs)


def _differences(model, reference) -> list[str]:
    """Names whose value (parameters whole, buffers too) differs from ``reference``'s."""
    expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    actual = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert actual.keys() == expected.keys(), actual.keys() ^ expected.keys()
    return [k for k, v in actual.items()
            if not torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, expected[k])]


def _bytes_read(monkeypatch_target: list) -> None:
    """Record (key, bytes the reader read from the files) of every read load_hf makes in
    this process."""
    original = SafetensorsFiles.read

    def read(self, key, index=None, into=None):
        before = self.bytes_read
        tensor = original(self, key, index, into)
        monkeypatch_target.append((key, self.bytes_read - before))
        return tensor

    SafetensorsFiles.read = read


def _load_each_model(root: str) -> dict:
    transformers.utils.logging.set_verbosity_error()
    reads: list = []
    _bytes_read(reads)
    out = {}
    for name in _configs():
        folder = os.path.join(root, name)
        model = _sharded(folder)
        reads.clear()
        load_hf(model, folder)
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                                      dtype=torch.float32)
        out[name] = {"differ": _differences(model, reference),
                     "read": sum(n for key, n in reads if ".experts." not in key),
                     "expected": _shard_bytes(model, folder)}
    return out


def _shard_bytes(model, folder: str) -> int:
    """Bytes of this rank's shards in the files' dtype, for the entries read directly."""
    files = SafetensorsFiles(folder)
    itemsize = next(iter(files.tensors.values())).torch_dtype.itemsize
    files.close()
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or ".experts." in name:
            continue
        seen.add(id(p))
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * itemsize
    return total

def test_a_model_built_on_meta_skips_its_weight_initialization_and_keeps_no_mark(
        monkeypatch):
    """Initializing meta tensors does nothing, slowly (torch's random fills run as Python
    decompositions there): parameters_on_meta marks its parameters so that transformers'
    initialization passes them by, and takes the marks away at the end of the block."""
    from transformers import initialization

    fills = []
    normal = initialization.TORCH_INIT_FUNCTIONS["normal_"]
    monkeypatch.setitem(initialization.TORCH_INIT_FUNCTIONS, "normal_",
                        lambda tensor, *a, **k: fills.append(tensor) or normal(tensor, *a, **k))
    config = transformers.LlamaConfig(**_COMMON)
    transformers.AutoModelForCausalLM.from_config(config)
    assert fills, "transformers' initialization no longer fills through normal_"
    fills.clear()
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert fills == []
    assert all(p.is_meta and not hasattr(p, "_is_hf_initialized")
               for p in model.parameters())



@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_llama_qwen_and_mixtral_load_as_from_pretrained(tmp_path, world_size):
    root = str(tmp_path)
    _save_models(root)
    for rank, models in enumerate(run_distributed(_load_each_model, world_size, root)):
        for name, result in models.items():
            assert result["differ"] == [], (rank, name)
            # each rank read the bytes of its own shards, no more (experts: read whole)
            assert result["read"] == result["expected"], (rank, name, result)


def _memory(root: str) -> dict:
    """The rise of anonymous resident memory while load_hf fills an fp32 Llama's shards
    from bf16 files, in a process that has allocated little before (the tiny Llama's
    load first: imports, transformers' tables)."""
    from fullshard.memory.process import (AnonymousPeak, current_rss_bytes, peak_rss_bytes,
                                          reset_peak_rss)
    transformers.utils.logging.set_verbosity_error()
    tiny = os.path.join(root, "llama")
    load_hf(_sharded(tiny), tiny)
    model = _sharded(os.path.join(root, "larger"))
    marked = reset_peak_rss()
    resident = current_rss_bytes()
    with AnonymousPeak() as memory:
        load_hf(model, os.path.join(root, "larger"))
    return {"rise": memory.rise, "rss_rise": peak_rss_bytes() - resident if marked else None,
            "shards": sum(p.to_local().nbytes for p in model.parameters()),
            "largest": max(p.numel() * p.element_size() for p in model.parameters())}


@pytest.mark.slow
def test_a_rank_holds_its_shards_and_no_more_than_one_tensor_besides(tmp_path):
    """Host memory per rank <= its shards + one tensor: the whole model is 80 MB in fp32,
    a rank's shards 40 MB, the largest tensor (an embedding) 17 MB; and its resident
    memory, the files' pages included, rises by its shards and a few MB."""
    root = str(tmp_path)
    _save_models(root)
    config = transformers.LlamaConfig(**{**_COMMON, "vocab_size": 8192, "hidden_size": 512,
                                         "intermediate_size": 1376, "num_hidden_layers": 4,
                                         "num_attention_heads": 8, "num_key_value_heads": 4})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(
        os.path.join(root, "larger"))
    for rank, out in enumerate(run_distributed(_memory, 2, root)):
        assert out["shards"] > 30e6 and out["largest"] > 15e6, out
        assert out["rise"] <= out["shards"] + out["largest"], (rank, out)
        assert out["rise"] >= 0.9 * out["shards"], (rank, out)  # the measure sees the shards
        if out["rss_rise"] is not None:  # all resident memory, the files' pages included:
            # they are read, not mapped (a mapping kept them resident: 1.7x the shards)
            assert out["rss_rise"] <= 1.2 * out["shards"], (rank, out)


def _layouts(root: str) -> dict:
    """A model already real (loaded in place), shards on dim 1, a (replicate, shard)
    mesh, and an error on one rank, which every rank raises."""
    from torch.distributed.device_mesh import init_device_mesh
    transformers.utils.logging.set_verbosity_error()
    folder = os.path.join(root, "llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = {}
    real = _sharded(folder, on_meta=False)
    addresses = [p.to_local().data_ptr() for p in real.parameters()]
    load_hf(real, folder)
    out["in place"] = (_differences(real, reference),
                       addresses == [p.to_local().data_ptr() for p in real.parameters()])
    dim1 = _sharded(folder, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    load_hf(dim1, folder)
    out["dim 1"] = _differences(dim1, reference)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    hybrid = _sharded(folder, mesh=mesh)
    load_hf(hybrid, folder)
    out["hybrid"] = _differences(hybrid, reference)
    broken = _sharded(folder)
    original = SafetensorsFiles.read
    if dist.get_rank() == 1:
        def unreadable(self, key, index=None, into=None):
            raise OSError(5, "Input/output error")
        SafetensorsFiles.read = unreadable
    try:
        load_hf(broken, folder)
        out["one rank failed"] = "nothing raised"
    except CheckpointError as err:
        out["one rank failed"] = str(err)
    SafetensorsFiles.read = original
    return out


@pytest.mark.slow
def test_in_place_dim_1_hybrid_and_an_error_on_one_rank(tmp_path):
    root = str(tmp_path)
    _save_models(root)
    ranks = run_distributed(_layouts, 2, root)
    for out in ranks:
        assert out["in place"] == ([], True)
        assert out["dim 1"] == [] and out["hybrid"] == []
        assert out["one rank failed"] == (
            f"load_hf: loading {root}/llama failed on 1 of 2 ranks (rank 1: OSError: [Errno 5] "
            "Input/output error); every rank stops here (the model may hold part of the "
            "weights). Fix what the failed ranks name and load again.")


def _checkpointed(checkpoint_dir: str, model) -> dict:
    """The state dict of ``model`` with the weights of the checkpoint (one process's)."""
    from fullshard import checkpoint
    checkpoint.load(checkpoint_dir, model)
    return model.state_dict()


def _round_trips(runs: dict) -> dict:
    """fullshard's own exports load back sharded: a GPT's ``.safetensors`` into the GPT,
    its ``--hf`` folder into transformers' GPT-2, Llama and Mixtral runs' ``--hf`` folders
    into their models; each against the checkpoint it was exported from."""
    import dataclasses

    from fullshard.gpt import GPT
    from fullshard.train.config.schema import get_preset
    transformers.utils.logging.set_verbosity_error()
    shape = dataclasses.replace(get_preset("debug").gpt, tie_embeddings=False)
    with torch.device("meta"):
        gpt = GPT(shape)
    for layer in gpt.layers:
        fully_shard(layer)
    fully_shard(gpt)
    run, exported = runs["gpt"]
    load_hf(gpt, exported)
    out = {"gpt": _state_differences(gpt, _checkpointed(_step(run), GPT(shape)))}
    for name, (run, folder) in runs.items():
        if name == "gpt":
            continue
        model = _sharded(folder)
        load_hf(model, folder)
        if name == "gpt2":  # the GPT's export, which test_export_hf.py compares with it
            reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
            out[name] = _state_differences(model, reference.state_dict())
            continue
        config = transformers.AutoConfig.from_pretrained(folder)
        plain = _checkpointed(_step(run), transformers.AutoModelForCausalLM.from_config(config))
        out[name] = _state_differences(model, plain)
    return out


def _step(run: str) -> str:
    return os.path.join(run, "checkpoints", "step_000003")


def _state_differences(model, expected: dict) -> list[str]:
    actual = model.state_dict()
    assert actual.keys() == expected.keys()
    return [k for k, v in actual.items()
            if not torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, expected[k])]


def _hf_run(out: str, source: str) -> None:
    """OUT/config.toml of a ``--model hf:SOURCE`` run and a checkpoint of the model with
    its weights moved away from the saved ones."""
    from fullshard import checkpoint
    from fullshard.train.config.schema import get_preset, to_toml
    from fullshard.train.config.flags import apply_overrides
    cfg = apply_overrides(get_preset("debug"), {"model": f"hf:{source}"}, "test")
    os.makedirs(out)
    with open(os.path.join(out, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    checkpoint.save(_step(out), model, extra={"step": 3})


@pytest.mark.slow
def test_fullshard_exports_load_back_sharded(tmp_path):
    from fullshard.cli import main
    from support.hf_folders import gpt_run_folder
    _save_models(str(tmp_path))
    runs = {}
    gpt_run_folder(str(tmp_path / "gpt_run"), tie_embeddings=False)
    runs["gpt"] = (str(tmp_path / "gpt_run"), str(tmp_path / "gpt.safetensors"))
    assert main(["ckpt", "export", *runs["gpt"]]) == 0
    runs["gpt2"] = (str(tmp_path / "gpt_run"), str(tmp_path / "gpt2"))
    for name in ("llama", "mixtral"):
        _hf_run(str(tmp_path / f"{name}_run"), str(tmp_path / name))
        runs[name] = (str(tmp_path / f"{name}_run"), str(tmp_path / f"{name}_export"))
    for name in ("gpt2", "llama", "mixtral"):
        assert main(["ckpt", "export", *runs[name], "--hf", "--max-shard-size", "30KB"]) == 0
    for out in run_distributed(_round_trips, 3, runs):
        assert out == {"gpt": [], "gpt2": [], "llama": [], "mixtral": []}


@pytest.mark.parametrize("indexed", [False, True], ids=["listed", "named by the index"])
def test_a_safetensors_name_that_is_a_directory_is_named(tmp_path, indexed):
    name = "model-00001-of-00001.safetensors" if indexed else "model.safetensors"
    (tmp_path / name).mkdir()
    if indexed:
        (tmp_path / "model.safetensors.index.json").write_text(
            '{"weight_map": {"weight": "%s"}}' % name)
    with pytest.raises(CheckpointError, match=rf"load_hf: {tmp_path / name} is a directory, "
                                              "not a .safetensors file") as err:
        SafetensorsFiles(tmp_path)
    assert "\n" not in str(err.value)
