"""One needle prompt through the cached arm at each storage precision and retention, beside the baseline and the
full-precision cached run: what bench/compression.py and bench/peers.py (against kvpress) measure alike."""

from __future__ import annotations

from bench.needles import judge_case
from bench.workloads import case_prompt
from engine.arms.compare import agreement, run_arm
from engine.arms.registry import ArmContext, Sampling
from engine.config import Compression
from engine.session import Engine


def label(cfg) -> str:
    dtype, r, m = cfg
    if r >= 1.0:
        return dtype
    name = f"{m} {r:.0%}"
    return name if dtype == "float32" else f"{dtype} + {name}"


def run_prompt(eng: Engine, case: dict, idx: int, configs: list, sampling: Sampling) -> dict:
    n = case["modules"]
    schema, prompt = case_prompt(case, idx)
    lay = eng.layout(schema)
    plan = eng.plan(lay, prompt, sampling.max_new_tokens)
    store = eng.store()

    def found(run) -> bool:
        return judge_case(run.text, case)[0]

    def module_bytes(enc) -> int:
        return sum(store.entry_bytes(k) for path, k in enc.module_keys.items() if path)

    base = run_arm(ArmContext(eng.lm, plan, None, None, sampling), "baseline").run
    enc = eng.encode(lay, eng.config.with_(storage_dtype="float32", compression=Compression())).encoded
    ref = run_arm(ArmContext(eng.lm, plan, enc, store, sampling), "cached").run
    full_bytes, full_buffer = module_bytes(enc), ref.kv_buffer_bytes_after_retention
    row = {"modules": n, "depth": case["depth"], "prompt_tokens": plan.prompt_tokens, "number": case["number"],
           "module_bytes_fp32": full_bytes, "baseline": {"found": found(base)},
           "cached fp32": {"found": found(ref), **agreement(base, ref), "ttft_ms": ref.ttft_ms,
                           "decode_ms": ref.decode_ms_per_token, "store_ratio": 1.0, "buffer_ratio": 1.0}}
    for cfg in configs:
        dtype, r, m = cfg
        e = eng.encode(lay, eng.config.with_(storage_dtype=dtype, compression=Compression(r, m))).encoded
        run = run_arm(ArmContext(eng.lm, plan, e, store, sampling), "cached").run
        vs_ref, vs_base = agreement(ref, run), agreement(base, run)
        row[label(cfg)] = {"found": found(run), "store_ratio": module_bytes(e) / full_bytes,
                           "buffer_ratio": run.kv_buffer_bytes_after_retention / full_buffer,
                           "ttft_ms": run.ttft_ms, "copy_ms": run.copy_ms, "decode_ms": run.decode_ms_per_token,
                           "agree_ref": vs_ref["first_token_agree"], "kl_ref": vs_ref["first_token_kl"],
                           "agree_base": vs_base["first_token_agree"], "kl_base": vs_base["first_token_kl"]}
    for key in list(store.keys()):  # modules are not shared between prompts
        store.evict(key)
    return row
