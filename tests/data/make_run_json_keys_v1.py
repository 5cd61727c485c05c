"""Snapshot of the `run --json` key paths as written by the code before the arms refactor (run at 9d7bb5f with
conftest.make_tiny_llama copied in: the seed-0 tiny Llama of its tiny_lm fixture)."""
import json, sys, pathlib
sys.path.insert(0, "tests")
from conftest import SAMPLES, make_tiny_llama
from engine.model.load import load_tokenizer, wrap_model
from engine.session import Engine
import torch
from transformers import LlamaConfig, LlamaForCausalLM

_, tok, _ = load_tokenizer("SmolLM2-135M-Instruct")  # the small model the tests run
lm = make_tiny_llama(tok)
eng = Engine.from_loaded(lm)
from engine.arms.registry import Sampling
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
