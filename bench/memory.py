"""Memory per cached token (the paper's Table 2), and measured store bytes against the prediction.

1. KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element, for the
   loaded model and — from configs alone, no weights — for the families in the paper's
   Table 2 (Llama 2 7B/13B/70B, Falcon 7B/40B, MPT 7B/30B) and current small models. The
   config numbers below are the published architecture hyper-parameters of each model.
2. For every sample schema: the bytes the module store really holds after encoding, against
   the prediction (KV bytes per token x tokens the layout says are stored: the anonymous
   text, every cached module's own tokens once, every scaffold's joint span). They must be equal.

    python bench/memory.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import ROOT, bench_model, emit, machine, model_help, table

from engine.model.load import kv_bytes_per_token, kv_shape
from engine.session import Engine

# Published architecture hyper-parameters (config.json of each model), enough to size the KV cache.
CONFIGS = {
    "Llama-2-7B": ("llama", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                                 num_hidden_layers=32)),
    "Llama-2-13B": ("llama", dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=40,
                                  num_hidden_layers=40)),
    "Llama-2-70B": ("llama", dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                                  num_hidden_layers=80)),
    "Falcon-7B": ("falcon", dict(hidden_size=4544, num_attention_heads=71, num_hidden_layers=32, multi_query=True,
                                 new_decoder_architecture=False)),
    "Falcon-40B": ("falcon", dict(hidden_size=8192, num_attention_heads=128, num_hidden_layers=60,
                                  new_decoder_architecture=True, num_kv_heads=8)),
    "MPT-7B": ("mpt", dict(d_model=4096, n_heads=32, n_layers=32)),
    "MPT-30B": ("mpt", dict(d_model=7168, n_heads=64, n_layers=48)),
    "SmolLM2-135M": ("llama", dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                   num_hidden_layers=30)),
    "SmolLM2-360M": ("llama", dict(hidden_size=960, num_attention_heads=15, num_key_value_heads=5,
                                   num_hidden_layers=32)),
    "SmolLM2-1.7B": ("llama", dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=32,
                                   num_hidden_layers=24)),
    "Qwen2.5-0.5B": ("qwen2", dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                   num_hidden_layers=24)),
    "Qwen2.5-7B": ("qwen2", dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                 num_hidden_layers=28)),
    "Llama-3.2-1B": ("llama", dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                                   num_hidden_layers=16, head_dim=64)),
    "Llama-3.1-8B": ("llama", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                   num_hidden_layers=32)),
    "Mistral-7B": ("mistral", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                   num_hidden_layers=32)),
}


def make_config(family: str, kwargs: dict):
    from transformers import FalconConfig, LlamaConfig, MistralConfig, MptConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "falcon": FalconConfig, "mpt": MptConfig, "qwen2": Qwen2Config,
           "mistral": MistralConfig}[family]
    return cls(**kwargs)


def predicted_stored_tokens(lay) -> int:
    """Tokens the store should hold for a layout: anonymous + cached modules' own + scaffold spans."""
    anon = lay.anonymous_tokens()
    own = sum(len(lay.pieces[i]) for m in lay.modules.values() if m.cache for i in m.pieces)
    scaffolds = sum(len(lay.pieces[i]) for s in lay.schema.scaffolds for i in lay.scaffold_unit(s.name)[1])
    return anon + own + scaffolds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two samples only, no files written")
    ap.add_argument("--model", default=None, help=model_help())
    args = ap.parse_args()

    families = []
    for name, (family, kwargs) in CONFIGS.items():
        cfg = make_config(family, kwargs)
        layers, kv, dim = kv_shape(cfg)
        fp16 = kv_bytes_per_token(cfg, 2)
        families.append({"model": name, "layers": layers, "kv_heads": kv, "head_dim": dim,
                         "fp16_bytes_per_token": fp16, "fp16_mb_per_token": round(fp16 / 2**20, 4),
                         "fp32_bytes_per_token": 2 * fp16, "fp16_gib_per_4k_tokens": round(fp16 * 4096 / 2**30, 3)})
    print(table(["model", "layers", "kv heads", "head dim", "MB/token fp16", "GiB per 4K tokens fp16"],
                [[f["model"], f["layers"], f["kv_heads"], f["head_dim"], f["fp16_mb_per_token"],
                  f["fp16_gib_per_4k_tokens"]] for f in families]))

    eng = Engine(model=bench_model(args.model, args.quick).spec, persist=False)
    lm = eng.lm
    loaded = {"model": lm.name, "dtype": lm.dtype, "kv_bytes_per_token": lm.kv_bytes_per_token,
              "layers": lm.n_layers, "kv_heads": lm.kv_heads, "head_dim": lm.head_dim}
    print(f"\nloaded: {lm.name} ({lm.dtype}) {lm.kv_bytes_per_token:,} KV bytes per token")

    samples = []
    paths = sorted(p for p in (ROOT / "sample_schemas").glob("*.xml") if not p.name.endswith(".prompt.xml"))
    for path in paths[:2] if args.quick else paths:
        fresh = Engine.from_loaded(lm)  # an empty store: bytes belong to this schema alone
        lay = fresh.layout(path.read_text(), str(path))
        enc = fresh.encode(lay)
        tokens = predicted_stored_tokens(lay)
        predicted = tokens * lm.kv_bytes_per_token
        samples.append({"schema": path.stem, "stored_tokens": tokens, "predicted_bytes": predicted,
                        "measured_bytes": enc.store_bytes, "match": predicted == enc.store_bytes,
                        "entries": len(fresh.store())})
    print(table(["schema", "stored tokens", "predicted bytes", "measured bytes", "equal"],
                [[s["schema"], s["stored_tokens"], s["predicted_bytes"], s["measured_bytes"], s["match"]]
                 for s in samples]))
    emit("memory", {"benchmark": "memory", "machine": machine(), "loaded": loaded, "families": families,
                    "samples": samples, "all_match": all(s["match"] for s in samples)}, write=not args.quick)


if __name__ == "__main__":
    main()
