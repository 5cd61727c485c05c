"""Models of a named Llama shape with random weights (``--random-shape``): TTFT depends on the shapes of the work,
not on the weights' values (bench/ttft.py, bench/gpu_profile.py)."""

from __future__ import annotations


# Llama shapes for --random-shape (LlamaConfig fields); the vocabulary is the tokenizer's
SHAPES = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    # the same code path at a size a CPU runs in seconds (tests, smoke runs)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
}


def random_model(shape: str, spec: str | None, device: str, dtype: str):
    """A LoadedModel of Llama shape ``shape`` with random weights (seed 0), built in ``dtype`` on ``device``
    (no full-precision copy on the CPU first), tokenizing with model ``spec``'s tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.devices import check_device
    from engine.model.load import load_tokenizer, wrap_model

    check_device(device)
    tok_name, tok, _ = load_tokenizer(spec)
    cfg = LlamaConfig(**SHAPES[shape], vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.eval()
    return wrap_model(model, tok, f"{shape}-random", device=device, dtype=dtype,
                      max_positions=cfg.max_position_embeddings), tok_name, cfg
