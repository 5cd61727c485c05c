"""Snapshot of the `run --json` key paths as written by the code before the arms refactor."""
import json, sys, pathlib
sys.path.insert(0, "tests")
from conftest import SAMPLES
from engine.models import load_tokenizer, wrap_model
from engine.session import Engine
import torch
from transformers import LlamaConfig, LlamaForCausalLM

_, tok, _ = load_tokenizer(None)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=True, attn_implementation="sdpa")
torch.manual_seed(0)
lm = wrap_model(LlamaForCausalLM(cfg).eval(), tok, "tiny-llama", fingerprint="tiny-llama-seed0")
eng = Engine.from_loaded(lm)
from engine.runner import Sampling
s = (SAMPLES / "travel.xml").read_text(); p = (SAMPLES / "travel.prompt.xml").read_text()
paths = set()
def walk(x, pre):
    if isinstance(x, dict):
        for k, v in x.items():
            q = f"{pre}.{k}" if pre else k
            paths.add(q)
            walk(v, q)
    elif isinstance(x, list) and x and isinstance(x[0], dict):
        for v in x:
            walk(v, pre + "[]")
for arms, repair in ((("baseline", "prefix", "cached"), 0), (("baseline", "prefix", "cached"), 2)):
    c = eng.compare(s, p, Sampling(max_new_tokens=3), config=eng.config.with_(arms=arms, repair=repair))
    walk(c.to_json(), "")
print(json.dumps(sorted(paths), indent=1))
