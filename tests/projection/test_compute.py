"""The compute model (projection/compute.py, Note [the compute model]): narrow matrix
multiplies further from peak, attention as its own cost, routed experts."""

from __future__ import annotations

import pytest

from fullshard.projection import DEVICES, FITTED, SHAPES, ModelShape
from fullshard.projection.compute import block_seconds, rates_for


def _block(shape: ModelShape, device: str, tokens: int, seq: int):
    dev = DEVICES[device]
    return block_seconds(shape, tokens, seq, rates_for(dev.peak_flops, dev.memory_bandwidth,
                                                       dev.arch), FITTED)


def test_narrow_matrix_multiplies_run_further_from_peak_and_more_so_on_an_h100():
    # Note [the compute model]: the additive roofline; a 768-wide block against an 8192-wide
    # one, as achieved FLOP/s per peak FLOP/s of each device
    def achieved(shape, device):
        block, _, _ = _block(shape, device, 8192, 512)
        flops = 3 * 2 * shape.block_matrix_params * 8192
        return flops / (block.forward + block.backward) / DEVICES[device].peak_flops
    narrow, wide = (ModelShape(f"d{d}", d, 1, d // 64, d // 64, 4 * d, 50000, True, False)
                    for d in (768, 8192))
    for device in ("a100", "h100"):
        assert achieved(narrow, device) < 0.85 * achieved(wide, device)
    assert achieved(narrow, "h100") / achieved(wide, "h100") \
        < achieved(narrow, "a100") / achieved(wide, "a100")


def test_attention_is_its_own_cost_and_grows_with_the_sequence():
    shape = SHAPES["llama2-7b"]
    short, _, _ = _block(shape, "a100", 16384, 2048)
    long, _, _ = _block(shape, "a100", 16384, 32768)  # the same tokens, 16x the context
    assert long.forward > 1.3 * short.forward


def test_a_first_generation_flash_attention_kernel_runs_attention_at_its_own_rate():
    # Note [attention by kernel, not by sequence length]: only attention's time changes,
    # by 1 / flash1, whatever the sequence
    shape, dev = SHAPES["llama2-7b"], DEVICES["a100"]
    rates = rates_for(dev.peak_flops, dev.memory_bandwidth, dev.arch)
    for seq in (2048, 32768):
        flash2, _, _ = block_seconds(shape, 32768, seq, rates, FITTED, "flash2")
        flash1, _, _ = block_seconds(shape, 32768, seq, rates, FITTED, "flash1")
        attention = rates.attention_seconds(2 * 32768 * seq * shape.q_width)
        assert flash1.forward - flash2.forward == pytest.approx(
            attention * (1 / FITTED.flash1 - 1), rel=1e-9)
        assert flash1.backward - flash2.backward == pytest.approx(
            2.5 * attention * (1 / FITTED.flash1 - 1), rel=1e-9)
    assert 0 < FITTED.flash1 < 1


def test_the_moe_preset_is_projected_with_its_experts():
    from fullshard.gpt import PRESET_SHAPES
    from fullshard.projection import shape_of
    cfg = PRESET_SHAPES["moe"]
    shape = shape_of(cfg, "moe")
    assert (shape.n_experts, shape.top_k) == (cfg.n_experts, cfg.top_k)
    # biases and the learned positions' arithmetic aside, the model's own counts
    assert shape.num_params == pytest.approx(cfg.num_params(), rel=0.02)
    assert shape.active_params == pytest.approx(cfg.active_params(), rel=0.02)
    assert shape.active_params < 0.5 * shape.num_params
    tokens = 4096
    routed = _block(shape, "h100", tokens, 64)[0]
    one_expert_dense = ModelShape("d", shape.d_model, shape.n_layers, shape.n_heads,
                                  shape.n_kv_heads, shape.ffn_hidden, shape.vocab_size,
                                  shape.tied, False, learned_positions=shape.learned_positions)
    assert routed.forward > _block(one_expert_dense, "h100", tokens, 64)[0].forward


def test_compilation_saves_its_share_of_a_blocks_elementwise_time_and_launches():
    # Note [what compilation saves]: a compiled block's matrix multiplies and attention are
    # the eager block's; its elementwise passes and launches are 1 - compile_saving of them
    from dataclasses import replace

    shape, dev = SHAPES["llama3-8b"], DEVICES["h100"]
    rates = rates_for(dev.peak_flops, dev.memory_bandwidth, dev.arch)
    eager, full_eager, sel_eager = block_seconds(shape, 16384, 8192, rates, FITTED)
    compiled, full, sel = block_seconds(shape, 16384, 8192, rates, FITTED, fused=True)
    # the same block with no elementwise work and no launches: what compilation cannot touch
    bare = replace(FITTED, elementwise={k: 0.0 for k in FITTED.elementwise})
    kernels, _, _ = block_seconds(shape, 16384, 8192,
                                  replace(rates, overhead=0.0), bare)
    fusable = (eager.forward + eager.backward) - (kernels.forward + kernels.backward)
    saved = (eager.forward + eager.backward) - (compiled.forward + compiled.backward)
    assert 0 < FITTED.compile_saving < 1
    assert saved == pytest.approx(FITTED.compile_saving * fusable, rel=1e-9)
    assert compiled.overhead == pytest.approx((1 - FITTED.compile_saving) * eager.overhead)
    assert full < full_eager and sel < sel_eager  # recomputation runs the fused kernels too
