"""Full prefill against the machine's GEMM floor and llama.cpp (issue 46), in one run.

    python bench/prefill.py [--lengths 512,1024,2048,4096] [--repeats 3] [--threads 2] [--kernels auto,blocks]

* **studio**: the default model on its default (gguf) weights prefills the same essay tokens from an empty KV cache
  (the model's forward, first token's logits) with each prefill kernel (engine/model/prefill.py: ``auto`` is what
  this CPU gets, ``blocks`` today's path); median, min and max of ``--repeats``.
* **linears**: one more prefill per length with every prefill GEMM timed: the share of the prefill the linears take
  and the share of the floor they reach.
* **floors**: the 24 layers' linears as bare ``F.linear`` at the model's shapes, bf16 and fp32 (and int8 dynamic),
  at each length, in this run: bf16 is "the floor" of the issue where the CPU has bf16 matrix units; where it has
  none, bf16 is emulated and the fastest precision measured here is the floor that can be judged.
* **llama.cpp**: llama-cpp-python in .peers/llama (``make peers``), same GGUF, same threads, flash attention on, the
  same token ids, in its own process (a crash is reported, not fatal); a build that uses AMX on a CPU with AMX is
  refused (its prefill segfaults there: docs/benchmarks.md).
* **encoding**: the module encoding of an 8-document schema (~2.3K tokens), each kernel, fresh store each time.
* **answers**: first-token KL of each kernel against an fp32 prefill (the same weights' values in fp32), and
  greedy decode ms/token after a 512-token prefill for each kernel.

The JSON is printed last and saved as bench/results/prefill.json; bench/report.py puts it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, doc_schema, emit, essay_chunks, fill_docs, machine, model_help, spread, table

from bench.peer_envs import run_peer

from bench.llama_build import AMX_FLAGS
from bench.tables import FLOORS, KERNEL_FLOOR


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernels", default="auto,blocks", help="prefill kernels to time (engine/model/prefill.py)")
    p.add_argument("--floor-dtypes", default="bfloat16,float32,float32-onednn,int8",
                   help="float32: MKL's sgemm (F.linear); float32-onednn: oneDNN's matmul")
    p.add_argument("--encode-tokens", type=int, default=2300)
    p.add_argument("--encode-repeats", type=int, default=None, help="default: --repeats")
    p.add_argument("--kl-kernels", default="gemm-int8",
                   help="kernels whose first-token KL against the fp32 prefill is measured besides --kernels' first")
    p.add_argument("--model", default=None, help=model_help(quick=False) + "; llama.cpp runs its GGUF")
    p.add_argument("--weights", default="gguf")
    p.add_argument("--profile-length", type=int, default=None,
                   help="torch.profiler breakdown of one prefill of this many tokens (default: the longest; 0: none)")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from engine.model import prefill
    from engine.model.load import load_model

    lengths = [int(x) for x in args.lengths.split(",")]
    model = bench_model(args.model)
    gguf = None if args.no_llama else model.gguf_file()
    lm = load_model(model.spec, weights=args.weights)
    auto = lm.prefill
    kernels = [auto.kernel if k == "auto" else k for k in args.kernels.split(",")]
    chunks = essay_chunks(lm.codec.encode, 400)
    ids = [t for c in chunks for t in lm.codec.encode(" " + c)][: max(lengths)]
    print(f"model {lm.name} ({lm.weights}); auto prefill kernel: {auto.kernel} ({auto.why}); "
          f"loadavg {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    out = {"machine": {**machine(), **cpu_facts()}, "model": lm.name, "gguf": gguf.name if gguf else None,
           "weights": lm.weights,
           "auto": {"kernel": auto.kernel, "why": auto.why, "copy_bytes": auto.nbytes},
           "lengths": lengths, "repeats": args.repeats,
           "floors": floors(lm.model, lengths, args.floor_dtypes.split(",")),
           "attention_floors": attention_floors(lm.model, lengths)}
    out["studio"] = {k: studio(lm, k, ids, lengths, args.repeats) for k in kernels}
    out["kl"] = kl(lm, list(dict.fromkeys([kernels[0], *filter(None, args.kl_kernels.split(","))])), ids, lengths)
    out["decode"] = {k: decode_ms(lm, k, ids[:512]) for k in kernels}
    out["encoding"] = {k: encoding(lm, k, chunks, args.encode_tokens, args.encode_repeats or args.repeats)
                       for k in kernels}
    profile_n = max(lengths) if args.profile_length is None else args.profile_length
    out["profile"] = profile(lm, kernels[0], ids[:profile_n]) if profile_n else None
    prefill.use(lm.model, "auto")
    out["llama_cpp"] = {"error": "skipped (--no-llama)"} if args.no_llama else \
        llama(gguf, ids, lengths, args.repeats, args.threads)
    out["verdicts"] = verdicts(out, kernels)
    print_tables(out, kernels)
    emit("prefill", out, write=not args.no_write)


def cpu_facts() -> dict:
    import torch

    from engine.model import prefill
    from engine.model.kernels import _cpu_flags

    flags = _cpu_flags()
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_units": not prefill.bf16_units(), "amx": any(f in flags for f in AMX_FLAGS),
            "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags}


def layer_shapes(model) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's packed linears as the prefill multiplies them."""
    from engine.model.weights import PackedLinear

    layer = model.model.layers[0]
    return [(m.out_features, m.in_features) for m in layer.modules() if isinstance(m, PackedLinear)]


def floors(model, lengths: list[int], dtypes: list[str]) -> dict:
    """Seconds the model's layers' linears take as bare GEMMs at each length, by dtype (best of 2; 1 where slow)."""
    import torch
    import torch.nn.functional as F

    shapes, layers = layer_shapes(model), len(model.model.layers)
    out: dict = {"shapes": shapes, "layers": layers}
    for dtype in dtypes:
        per = {}
        for n in lengths:
            total = 0.0
            for rows, cols in shapes:
                x, w = torch.randn(n, cols), torch.randn(rows, cols) / cols ** 0.5
                f = _int8_gemm(x, w) if dtype == "int8" else _onednn_gemm(x, w) if dtype == "float32-onednn" else (
                    lambda x=x.to(getattr(torch, dtype)), w=w.to(getattr(torch, dtype)): F.linear(x, w))
                total += _best(f, 1 if dtype == "bfloat16" and not cpu_facts()["bf16_units"] else 2)
            flops = 2 * n * sum(r * c for r, c in shapes) * layers
            per[str(n)] = {"s": round(total * layers, 3), "tflops": round(flops / (total * layers) / 1e12, 3)}
            print(f"floor {dtype} {n}: {total * layers:.2f} s", file=sys.stderr, flush=True)
        out[dtype] = per
    return out


def attention_floors(model, lengths: list[int]) -> dict:
    """Seconds the layers' causal attention alone takes at each length (fused SDPA, ``is_causal``, grouped KV heads
    not repeated), fp32 and bf16: what attention costs at the model's shapes on this CPU, best of 2."""
    import torch
    import torch.nn.functional as F

    c = model.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    out: dict = {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "layers": c.num_hidden_layers}
    for dtype in ("float32", "bfloat16"):
        per = {}
        for n in lengths:
            q = torch.randn(1, heads, n, dim).to(getattr(torch, dtype))
            k, v = (torch.randn(1, kv_heads, n, dim).to(q.dtype) for _ in range(2))
            with torch.inference_mode():
                s = _best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 2)
            flops = 4 * heads * dim * n * (n + 1) / 2 * c.num_hidden_layers  # QK^T and PV over the causal half
            per[str(n)] = {"s": round(s * c.num_hidden_layers, 5),
                           "tflops": round(flops / (s * c.num_hidden_layers) / 1e12, 3)}
            print(f"attention floor {dtype} {n}: {per[str(n)]['s']:.2f} s", file=sys.stderr, flush=True)
        out[dtype] = per
    return out


# where a prefill's self time goes, by the op's name (torch.profiler's key averages)
PROFILE_GROUPS = (("linears", ("mm", "addmm", "bmm", "linear", "matmul", "mkldnn", "quantized", "onednn", "gemm")),
                  ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")),
                  ("copies and layout", ("copy_", "clone", "contiguous", "cat", "index_copy", "to", "_to_copy",
                                         "transpose", "view", "reshape", "expand", "slice", "select", "empty",
                                         "as_strided", "stack", "unsqueeze", "permute", "narrow")),
                  ("norms, rope and activations", ("mul", "add", "silu", "neg", "rsqrt", "pow", "mean", "sub",
                                                   "cos", "sin", "norm", "div", "exp", "embedding")))


def profile(lm, kernel: str, ids: list[int]) -> dict:
    """One full prefill of ``ids`` under torch.profiler: seconds of self time by group and the 12 costliest ops."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from engine.model import prefill

    prefill.use(lm.model, kernel)
    forward(lm, ids[:64])
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = forward(lm, ids)[0]
    ops = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()]
    groups = {name: 0.0 for name, _ in PROFILE_GROUPS} | {"other": 0.0}
    for key, s, _ in ops:
        groups[_group(key)] += s
    top = sorted(ops, key=lambda o: -o[1])[:12]
    print(f"profile {kernel} {len(ids)}: " + ", ".join(f"{g} {s:.2f} s" for g, s in groups.items()),
          file=sys.stderr, flush=True)
    return {"kernel": kernel, "tokens": len(ids), "wall_s": round(wall, 3),
            "groups": {g: round(s, 5) for g, s in groups.items()},
            "top_ops": [{"op": k, "self_s": round(s, 5), "calls": n, "group": _group(k)} for k, s, n in top]}


def _group(op: str) -> str:
    """The group of a profiled op: its name (namespace and leading underscores dropped) is one of a group's words,
    starts or ends with one as a part (``mul_``, ``_weight_int8pack_mm``), or holds one of over four letters."""
    name = op.split("::")[-1].lower().lstrip("_")
    for group, words in PROFILE_GROUPS:
        if any(name == w or name.startswith(w + "_") or name.endswith("_" + w) or len(w) > 4 and w in name
               for w in words):
            return group
    return "other"


def _onednn_gemm(x, w):
    from engine.model.prefill import onednn_linear

    return lambda: onednn_linear(x, w, None)


def _int8_gemm(x, w):
    import torch

    scale = (w.abs().amax(1) / 127).double()
    q = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    return lambda: torch.ops.quantized.linear_dynamic(x, packed, True)


def _best(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def forward(lm, ids: list[int]):
    """A full prefill from an empty cache: (seconds, first-token logits, the cache)."""
    import torch
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        t = time.perf_counter()
        logits = lm.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                          logits_to_keep=1).logits[0, -1]
        int(logits.argmax())
        return time.perf_counter() - t, logits.float(), cache


def studio(lm, kernel: str, ids: list[int], lengths: list[int], repeats: int) -> dict:
    from engine.model import prefill

    choice = prefill.use(lm.model, kernel)
    forward(lm, ids[:64])
    rows = {}
    for n in lengths:
        times = [forward(lm, ids[:n])[0] for _ in range(repeats)]
        linear = linear_seconds(lm, ids[:n]) if choice.kernel.startswith("gemm") else None
        rows[str(n)] = {**spread(times, 3), "tokens_per_s": round(n / statistics.median(times), 1),
                        "linear_s": None if linear is None else round(linear, 3)}
        print(f"studio {kernel} {n}: {rows[str(n)]}", file=sys.stderr, flush=True)
    return {"kernel": choice.kernel, "why": choice.why, "copy_bytes": choice.nbytes, "by_length": rows}


def linear_seconds(lm, ids: list[int]) -> float:
    """Seconds one prefill spends in its prefill GEMMs (each timed)."""
    from engine.model.weights import PackedLinear

    spent = [0.0]
    layers = [m for m in lm.model.modules() if isinstance(m, PackedLinear) and m.prefill is not None]
    for m in layers:
        inner = m.prefill

        def timed(x2, bias, inner=inner):
            t = time.perf_counter()
            y = inner(x2, bias)
            spent[0] += time.perf_counter() - t
            return y
        timed.start, timed.inner = inner.start, inner
        m.prefill = timed
    try:
        forward(lm, ids)
    finally:
        for m in layers:
            m.prefill = m.prefill.inner
    return spent[0]


def kl(lm, kernels: list[str], ids: list[int], lengths: list[int]) -> dict:
    """First-token KL of each kernel's prefill against the fp32 prefill, by length."""
    import torch

    from engine.model import prefill

    prefill.use(lm.model, "gemm-fp32")
    ref = {n: forward(lm, ids[:n])[1].log_softmax(-1) for n in lengths}
    out = {}
    for k in kernels:
        if k == "gemm-fp32":  # the reference itself
            out[k] = {"mean_kl": 0.0, "by_length": {str(n): {"kl": 0.0, "same_token": True} for n in lengths},
                      "note": "the reference: fp32 GEMMs over the same weights' values"}
            continue
        prefill.use(lm.model, k)
        per = {}
        for n in lengths:
            got = forward(lm, ids[:n])[1].log_softmax(-1)
            per[str(n)] = {"kl": float(torch.sum(ref[n].exp() * (ref[n] - got))),
                           "same_token": bool(int(got.argmax()) == int(ref[n].argmax()))}
        out[k] = {"mean_kl": round(statistics.mean(v["kl"] for v in per.values()), 6), "by_length": per}
    return out


def decode_ms(lm, kernel: str, ids: list[int], steps: int = 16) -> dict:
    """Greedy decode ms/token after a prefill of ``ids`` (decode steps are one row: the packed blocks)."""
    import torch

    from engine.model import prefill

    prefill.use(lm.model, kernel)
    _, logits, cache = forward(lm, ids)
    gaps, tok, pos = [], int(logits.argmax()), len(ids)
    with torch.inference_mode():
        for _ in range(steps):
            t = time.perf_counter()
            out = lm.model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]),
                           past_key_values=cache, use_cache=True)
            tok, pos = int(out.logits[0, -1].argmax()), pos + 1
            gaps.append((time.perf_counter() - t) * 1000)
    return spread(gaps[1:], 2, every=False)


def encoding(lm, kernel: str, chunks: list[str], tokens: int, repeats: int) -> dict:
    """Seconds to encode an 8-document schema's modules, fresh in-memory store each time."""
    from engine.model import prefill
    from engine.session import Engine

    prefill.use(lm.model, kernel)
    eng = Engine.from_loaded(lm)
    docs = fill_docs(eng, [c for c in chunks if len(eng.codec.encode(c)) > 200][:8], tokens)
    schema = doc_schema("prefill8", docs)
    layout = eng.layout(schema)
    times = []
    for _ in range(repeats):
        eng = Engine.from_loaded(lm)
        t = time.perf_counter()
        eng.encode(layout)
        times.append(time.perf_counter() - t)
    print(f"encoding {kernel}: {times}", file=sys.stderr, flush=True)
    return {"documents": len(docs), "tokens": layout.length, **spread(times, 3)}


def llama(gguf: Path, ids: list[int], lengths: list[int], repeats: int, threads: int) -> dict:
    """llama.cpp's full prefill + first token of the same ids on ``gguf`` (the studio's model), in its own process."""
    job = {"gguf": str(gguf), "n_ctx": max(lengths) + 64, "threads": threads, "new_tokens": 1,
           "flash_attn": True, "modes": ["full"], "prompts": [{"ids": ids[:n], "reps": repeats} for n in lengths]}
    got = run_peer("llama.cpp", "peer_llama.py", job)  # refuses an AMX build on an AMX CPU
    if "error" in got:
        return got
    by = {}
    for n in lengths:
        times = [r["ttft_ms"] / 1000 for r in got["full"] if r["prefilled_tokens"] == n]
        by[str(n)] = {**spread(times, 3), "tokens_per_s": round(n / statistics.median(times), 1)}
    return {"version": got.get("version"), "system_info": got.get("system_info"), "model": got.get("model"),
            "flash_attn": True,
            "threads": threads, "by_length": by}


def verdicts(out: dict, kernels: list[str]) -> dict:
    """The issue's must-hold ratios, from this run's figures."""
    new, old = kernels[0], kernels[-1]
    fl, st, ll = out["floors"], out["studio"], out["llama_cpp"]
    used = KERNEL_FLOOR.get(st[new]["kernel"])
    rows = {}
    for n in (str(x) for x in out["lengths"]):
        s = st[new]["by_length"][n]
        fastest = min((d for d in FLOORS if n in fl.get(d, {})), key=lambda d: fl[d][n]["s"])
        row = {"fastest_floor": fastest, "prefill_over_fastest_floor": _ratio(s["median"], fl[fastest][n]["s"]),
               "nonlinear_s": None if s["linear_s"] is None else round(s["median"] - s["linear_s"], 3),
               "nonlinear_over_linears": None if s["linear_s"] is None else
               _ratio(s["median"] - s["linear_s"], s["linear_s"]),
               "attention_floor_fp32_s": out.get("attention_floors", {}).get("float32", {}).get(n, {}).get("s"),
               "prefill_over_bf16_floor": _ratio(s["median"], fl.get("bfloat16", {}).get(n, {}).get("s")),
               "linears_share_of_bf16_floor": _ratio(fl.get("bfloat16", {}).get(n, {}).get("s"), s["linear_s"])}
        if used and used in fl:
            row[f"prefill_over_{used}_floor"] = _ratio(s["median"], fl[used][n]["s"])
            row[f"linears_share_of_{used}_floor"] = _ratio(fl[used][n]["s"], s["linear_s"])
        if new != old:
            row["speedup_over_blocks"] = _ratio(st[old]["by_length"][n]["median"], s["median"])
        if "by_length" in ll:
            row["speedup_over_llama_cpp"] = _ratio(ll["by_length"][n]["median"], s["median"])
        rows[n] = row
    enc = out["encoding"]
    return {"new": new, "old": old, "by_length": rows,
            "encoding_speedup": _ratio(enc[old]["median"], enc[new]["median"]),
            "decode_ratio": _ratio(out["decode"][new]["median"], out["decode"][old]["median"]),
            "mean_first_token_kl": out["kl"][new]["mean_kl"]}


def _ratio(a, b):
    return None if not a or not b else round(a / b, 3)


def print_tables(out: dict, kernels: list[str]) -> None:
    rows = []
    for n in (str(x) for x in out["lengths"]):
        cells = [n] + [out["studio"][k]["by_length"][n]["median"] for k in kernels]
        cells += [out["llama_cpp"]["by_length"][n]["median"] if "by_length" in out["llama_cpp"] else "-"]
        cells += [out["floors"].get(d, {}).get(n, {}).get("s", "-") for d in FLOORS]
        rows.append(cells)
    print(table(["tokens", *[f"studio {k} s" for k in kernels], "llama.cpp s",
                 *[f"{d} floor s" for d in FLOORS]], rows), file=sys.stderr)


if __name__ == "__main__":
    main()
