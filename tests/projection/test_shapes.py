"""Model shapes (projection/shapes.py): the parameter counts of known dense models and the
total and active counts of mixtures of experts, read from their Hugging Face configs."""

from __future__ import annotations

import pytest

from fullshard.projection import SHAPES, ModelShape


def test_known_shapes_have_their_published_parameter_counts():
    assert SHAPES["llama3-8b"].num_params == pytest.approx(8.03e9, rel=1e-3)
    assert SHAPES["llama2-7b"].num_params == pytest.approx(6.738e9, rel=1e-3)
    assert SHAPES["llama3-70b"].num_params == pytest.approx(70.55e9, rel=1e-3)


def test_mixtures_of_experts_have_their_published_total_and_active_counts():
    from fullshard.projection.shapes import hf_shape_fields
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8,
               "intermediate_size": 14336, "vocab_size": 32000, "tie_word_embeddings": False,
               "num_local_experts": 8, "num_experts_per_tok": 2}
    qwen3 = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "intermediate_size": 6144, "moe_intermediate_size": 768, "vocab_size": 151936,
             "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
             "decoder_sparse_step": 1, "mlp_only_layers": []}
    for config, total, active in ((mixtral, 46.7e9, 12.9e9), (qwen3, 30.5e9, 3.3e9)):
        shape = ModelShape(config["model_type"], **hf_shape_fields(config, "config.json"))
        assert shape.num_params == pytest.approx(total, rel=5e-3), config["model_type"]
        assert shape.active_params == pytest.approx(active, rel=2e-2), config["model_type"]
        # a token's FLOPs: a dense model as wide as its top_k experts, and the router
        dense = ModelShape("dense", shape.d_model, shape.n_layers, shape.n_heads,
                           shape.n_kv_heads, shape.mlp_width * shape.top_k, shape.vocab_size,
                           False, True, head_dim=shape.head_dim)
        router = 3 * shape.n_layers * 2 * shape.d_model * shape.n_experts
        assert shape.model_flops_per_token(4096) == pytest.approx(
            dense.model_flops_per_token(4096) + router, rel=1e-12)
