"""kvpress as a peer, driven in its own environment (`make peers` builds it in .peers/kvpress).

Run by ``bench/peers.py``, never imported by the project: kvpress 0.5.5 needs transformers < 5.3,
the project runs 5.23. This process loads the same converted model folder (fp32) and, for each case
(context and question as token ids, the studio's own), does what kvpress's pipeline does
(``KVPressTextGenerationPipeline._forward``): prefill the context under the press
(``with press(model): model.model(context, past_key_values=cache)``, so the cache is compressed
before the question is seen), then its ``generate_answer`` (the question appended at positions
after the full context, greedy decode; here one question token at a time, see :func:`answer`). It records the answer, the context KV bytes the press left and
the prefill time. Prints one JSON document last.

    .peers/kvpress/bin/python bench/peer_kvpress.py job.json
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    torch.set_num_threads(job["threads"])
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    load_s = time.perf_counter() - t
    presses = [("none", None)] + [(f"{name} {kept:.0%}", getattr(kvpress, name)(compression_ratio=round(1 - kept, 4)))
                                  for kept in job["kept"] for name in job["presses"]]
    cfg = model.config  # the model as it loaded here: the studio's folder, so the studio's shape
    out = {"kvpress": getattr(kvpress, "__version__", "0.5.5"), "transformers": transformers.__version__,
           "torch": torch.__version__, "load_s": round(load_s, 2),
           "model": {"folder": job["model_dir"].rstrip("/").rsplit("/", 1)[-1], "architecture": cfg.model_type,
                     "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size},
           "names": [n for n, _ in presses[1:]], "cases": []}
    for i, case in enumerate(job["cases"]):
        ctx = torch.tensor([case["context_ids"]])
        q = torch.tensor([case["question_ids"]])
        res = {}
        for name, press in presses:
            cache = DynamicCache()
            with torch.inference_mode():
                t = time.perf_counter()
                with press(model) if press is not None else _null():
                    model.model(input_ids=ctx, past_key_values=cache)
                prefill_ms = (time.perf_counter() - t) * 1000
                kept_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
                kept_tokens = [layer.keys.shape[-2] for layer in cache.layers]
                # presses that mask instead of evicting (KVzip, AdaKV-style: "fake compression" in kvpress)
                # leave the entries in the cache and hide them in attention; count those as removed
                masked = [_masked(layer.self_attn) for layer in model.model.layers]
                heads = cache.layers[0].keys.shape[1]
                effective = sum(b * (1 - m / (heads * n)) for b, m, n in zip(
                    [lay.keys.nbytes + lay.values.nbytes for lay in cache.layers], masked, kept_tokens))
                text = answer(model, tokenizer, q, cache, ctx.shape[1], job["new_tokens"])
                for layer in model.model.layers:
                    if hasattr(layer.self_attn, "masked_key_indices"):
                        layer.self_attn.masked_key_indices = None
            res[name] = {"text": text, "context_bytes": int(round(effective)), "stored_bytes": int(kept_bytes),
                         "masked_entries": sum(masked), "prefill_ms": round(prefill_ms, 2),
                         "kept_tokens_per_layer": kept_tokens}
            print(f"kvpress [{i + 1}/{len(job['cases'])}] {name}: {prefill_ms:.0f} ms, {text[:60]!r}",
                  file=sys.stderr, flush=True)
        out["cases"].append(res)
    print(json.dumps(out))


def answer(model, tokenizer, q, cache, context_length: int, new_tokens: int) -> str:
    """kvpress's ``generate_answer`` (question at positions after the full context, greedy), with the question
    fed one token at a time: the same causal attention, but no multi-token mask, which transformers' SDPA
    path builds from layer 0's cache length and so cannot serve PyramidKV's unequal layers (kvpress relies on
    flash attention there, which this CPU does not have)."""
    import torch

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pos, out = context_length, None
    for t in q[0]:
        out = model(input_ids=t.view(1, 1), past_key_values=cache, position_ids=torch.tensor([[pos]]))
        pos += 1
    ids = [out.logits[0, -1].argmax()]
    while len(ids) < new_tokens and ids[-1].item() not in eos:
        out = model(input_ids=ids[-1].view(1, 1), past_key_values=cache, position_ids=torch.tensor([[pos]]))
        pos += 1
        ids.append(out.logits[0, -1].argmax())
    return str(tokenizer.decode(torch.stack(ids), skip_special_tokens=True))


def _masked(attn) -> int:
    idx = getattr(attn, "masked_key_indices", None)
    return 0 if idx is None else int(len(idx[0]))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    main()
