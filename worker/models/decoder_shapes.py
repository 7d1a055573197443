"""The parameters of a Llama-shaped Hugging Face decoder from its config.json alone, without transformers.

`dilocox plan --gpus N` weighs dozens of layouts of a 70B or 107B model in a few seconds of CPU; building
the model on the meta device costs little, but importing transformers to do it costs half of that budget.
For the families whose layout is fixed — Llama, Mistral, Qwen2 — the names and shapes follow from the
config (`decoder_param_specs`), in the order the model registers them; anything else (another family,
an option that changes the structure) answers None and the plan builds the model as before.
tests/test_memory_plan.py holds these specs equal to the meta-built model's for every preset and a Qwen2.
"""

from __future__ import annotations

# model_type -> whether q/k/v carry biases (Qwen2 always; Llama and Mistral by `attention_bias`)
FAMILIES = {"llama": None, "mistral": None, "qwen2": True}
# Config keys that change the structure beyond what is written here: refuse to guess.
_UNHANDLED = ("num_experts", "num_local_experts", "moe_intermediate_size")


def decoder_param_specs(config: dict, vocab: int) -> list[tuple[str, tuple[int, ...]]] | None:
    """(name, shape) of every parameter of the causal LM `config` describes with `vocab` tokens, in
    registration order; None for a structure this does not know (build the model instead)."""
    family = config.get("model_type")
    if family not in FAMILIES or any(config.get(key) for key in _UNHANDLED):
        return None
    try:
        width, mlp, layers = (
            int(config["hidden_size"]),
            int(config["intermediate_size"]),
            int(config["num_hidden_layers"]),
        )
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or width // heads)
    qkv_bias = FAMILIES[family] if FAMILIES[family] is not None else bool(config.get("attention_bias", False))
    out_bias = bool(config.get("attention_bias", False)) and family != "qwen2"
    mlp_bias = bool(config.get("mlp_bias", False)) and family == "llama"
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, width))]
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj, rows, cols, bias in (
            ("q_proj", heads * head_dim, width, qkv_bias),
            ("k_proj", kv_heads * head_dim, width, qkv_bias),
            ("v_proj", kv_heads * head_dim, width, qkv_bias),
            ("o_proj", width, heads * head_dim, out_bias),
        ):
            specs.append((f"{p}self_attn.{proj}.weight", (rows, cols)))
            if bias:
                specs.append((f"{p}self_attn.{proj}.bias", (rows,)))
        for proj, rows, cols in (("gate_proj", mlp, width), ("up_proj", mlp, width), ("down_proj", width, mlp)):
            specs.append((f"{p}mlp.{proj}.weight", (rows, cols)))
            if mlp_bias:
                specs.append((f"{p}mlp.{proj}.bias", (rows,)))
        specs += [(f"{p}input_layernorm.weight", (width,)), (f"{p}post_attention_layernorm.weight", (width,))]
    specs.append(("model.norm.weight", (width,)))
    if not config.get("tie_word_embeddings", False):  # tied: the head is the embedding, listed once
        specs.append(("lm_head.weight", (vocab, width)))
    return specs
