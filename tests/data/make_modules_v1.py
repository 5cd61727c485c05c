"""Writes tests/data/modules-v1: entries made by the pml-kv/1 code (commit 362f436) for the tiny model.

Run from the repository root at that commit: python tests/data/make_modules_v1.py tests/data/modules-v1
The files are kept as made then, so the format test loads what the previous version wrote.
"""
import sys, shutil, pathlib
sys.path.insert(0, ".")
sys.path.insert(0, "tests")
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from engine.model.load import load_tokenizer, wrap_model
from engine.session import Engine
from engine.config import Compression
from engine.arms.registry import Sampling
from test_module_memory import SCHEMA, PROMPT

out = pathlib.Path(sys.argv[1])
shutil.rmtree(out, ignore_errors=True)
_, tok, _ = load_tokenizer("SmolLM2-135M-Instruct")  # the small model the tests run
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=True, attn_implementation="sdpa")
torch.manual_seed(0)
lm = wrap_model(LlamaForCausalLM(cfg).eval(), tok, "tiny-llama", fingerprint="tiny-llama-seed0")
for settings in ({}, {"storage_dtype": "float16"}, {"compression": Compression(0.5, "pyramid")}):
    eng = Engine.from_loaded(lm, persist=True, module_dir=out, **settings)
    c = eng.compare(SCHEMA, PROMPT, Sampling(4))
    print(settings, c.cached.token_ids, float(c.cached.first_logits[:5].sum()))
print(sorted(p.name for p in out.iterdir()), sum(p.stat().st_size for p in out.iterdir()))
