"""Tiny Hugging Face `transformers` models, built in code (no download), for the planner tests.

Each is a real `transformers` class with its own configuration defaults and its own
initialisation (`init_weights()` runs the class's `_init_weights`); only sizes are shrunk
(hidden 64, 2 layers, vocab 128) and dropout is 0, as the planner refuses random ops.
`build(name)` returns the model under the current default device (use `torch.device("meta")`).

`build("hf:<model_type>")` is any other causal LM transformers knows, from its default config
shrunk the same way (`tiny_config`; nested text configs too), built by the
`hf_auto_parallel` spec's builder (logits out; eager attention where SDPA is missing).
"""

from __future__ import annotations

VOCAB = 128
NAMES = ("hf_llama", "hf_qwen2", "hf_mistral", "hf_gpt2", "hf_bert")


def available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def config(name: str):
    import transformers as T

    decoder = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if name == "hf_llama":
        cfg = T.LlamaConfig(**decoder)
    elif name == "hf_qwen2":
        cfg = T.Qwen2Config(**decoder)
    elif name == "hf_mistral":
        cfg = T.MistralConfig(**decoder)
    elif name == "hf_gpt2":  # LM head tied to the token embedding
        cfg = T.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            use_cache=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
        )
    elif name == "hf_bert":  # encoder; MLM decoder tied to the word embedding; padding row
        cfg = T.BertConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        )
    else:
        raise KeyError(name)
    cfg._attn_implementation = "sdpa"
    return cfg


def build(name: str):
    import transformers as T

    if name.startswith("hf:"):
        return build_family(name[3:])
    classes = {
        "hf_llama": T.LlamaForCausalLM,
        "hf_qwen2": T.Qwen2ForCausalLM,
        "hf_mistral": T.MistralForCausalLM,
        "hf_gpt2": T.GPT2LMHeadModel,
        "hf_bert": T.BertForMaskedLM,
    }
    return classes[name](config(name))


# sizes shrunk in any config that has them (most decoders name them alike; attribute_map
# translates for the others), and every dropout set to 0
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    head_dim=16,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# set only where the config has them: partial rotary, latent attention (MLA)
_TINY_IF_PRESENT = dict(
    rotary_dim=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    kv_lora_rank=32,
    q_lora_rank=32,
    moe_intermediate_size=64,
)


def _shrink(cfg) -> None:
    present = {k: v for k, v in _TINY_IF_PRESENT.items() if getattr(cfg, k, None) is not None}
    if "qk_rope_head_dim" in present:  # latent attention: the rotary part is the head dim,
        present["head_dim"] = present["qk_rope_head_dim"]  # and keys/values have every head
        present["num_key_value_heads"] = _TINY["num_attention_heads"]
    for key, value in {**_TINY, **present}.items():
        try:
            setattr(cfg, key, value)
        except (AttributeError, TypeError, ValueError):
            pass
    for key in list(cfg.to_dict()):
        if "dropout" in key or key.endswith("pdrop"):
            try:
                setattr(cfg, key, 0.0)
            except (AttributeError, TypeError, ValueError):
                pass


def tiny_config(model_type: str):
    import transformers as T

    cfg = T.AutoConfig.for_model(model_type)
    text = cfg.get_text_config()
    for c in {id(cfg): cfg, id(text): text}.values():
        _shrink(c)
    return cfg


def build_family(model_type: str):
    from torchtitan.models.hf_causal_lm.model import HFModelArgs, build_hf_causal_lm

    return build_hf_causal_lm(HFModelArgs(config=tiny_config(model_type)))
