"""llama.cpp as a peer, driven in its own environment (`make peers` builds it in .peers/llama).

Run by ``bench/peers.py``, never imported by the project: this process has llama-cpp-python and
none of the project's packages (no torch). It reads one job (JSON) and prints one JSON document last.

    .peers/llama/bin/python bench/peer_llama.py job.json

The job gives the GGUF file, the threads, and prompts as **token ids** (the studio's baseline ids:
the schema rendered with the model's chat template, so both sides prefill exactly the same
tokens). Two ways to run them:

* ``full``: every prompt prefilled from an empty KV cache (``Llama.reset``), then greedy decode.
* ``prefix``: llama.cpp's prefix reuse the way a server keeps it. The states of the warm-up
  prompts and of every earlier prompt are kept in RAM (``llama_state_get_data``, KV only); for a
  new prompt the state with the longest common token prefix is restored
  (``llama_state_set_data``) and ``Llama.generate`` drops the KV past the common prefix and
  prefills the rest. That is what llama-server's prompt cache does (``--cache-ram``: restore the
  cached prompt with the best prefix match). llama-cpp-python's own ``LlamaRAMCache`` does the same
  but also copies the n_batch x vocabulary logits array with every state (311 MB for Qwen's
  151,936-token vocabulary), which would put a copy in its TTFT that a server does not pay; so the
  state is saved and restored here with the same C calls, without it.

TTFT runs from the call (state restore included) to the first sampled token; decode ms/token is
the mean gap between the later tokens. Greedy (``temp=0``) throughout.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time


def load(job: dict):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=job["threads"],
                          n_threads_batch=job["threads"], n_batch=512, logits_all=False, verbose=False,
                          seed=0, **({"flash_attn": True} if job.get("flash_attn") else {}))
    return llama_cpp, llm


def loaded(llm) -> dict:
    """The model as llama.cpp read it from the GGUF's header: its name, architecture, layers and width."""
    meta = llm.metadata
    arch = meta.get("general.architecture", "")
    return {"name": meta.get("general.name"), "architecture": arch,
            "layers": int(meta.get(f"{arch}.block_count", 0)), "hidden": int(meta.get(f"{arch}.embedding_length", 0))}


def generate(llm, ids: list[int], new_tokens: int, stop: set[int]) -> dict:
    """Greedy decode of ``new_tokens`` from ``ids`` (Llama.generate reuses whatever prefix its KV holds)."""
    times, out = [], []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        if tok in stop:
            break
        out.append(int(tok))
        if len(out) >= new_tokens:
            break
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_ms": round((times[0] - t0) * 1000, 2), "generated": out,
            "decode_ms_per_token": round(sum(gaps) / len(gaps) * 1000, 2) if gaps else None}


def common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class StateCache:
    """Saved KV states of earlier prompts, looked up by the longest common token prefix."""

    def __init__(self, llama_cpp, llm):
        self.lib, self.llm, self.items = llama_cpp, llm, []

    def save(self, ids: list[int]) -> int:
        """Keep the KV of ``ids`` (the prompt just run: generated tokens are dropped first)."""
        llm, lib = self.llm, self.lib
        n = len(ids)
        llm._ctx.kv_cache_seq_rm(-1, n, -1)
        llm.n_tokens = n
        size = lib.llama_state_get_size(llm._ctx.ctx)
        buf = (ctypes.c_uint8 * int(size))()
        got = lib.llama_state_get_data(llm._ctx.ctx, buf, size)
        self.items.append((list(ids), bytes(buf[:got])))
        return int(got)

    def restore_best(self, ids: list[int]) -> int:
        """Restore the saved state sharing the longest prefix with ``ids``; return that prefix's length."""
        best, best_n = None, 0
        for saved, state in self.items:
            n = common(saved, ids)
            if n > best_n:
                best, best_n = (saved, state), n
        llm = self.llm
        held = common(llm.input_ids[: llm.n_tokens].tolist(), ids)
        if best is None or best_n <= held:
            return held  # the KV it holds already shares as long a prefix
        saved, state = best
        arr = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if self.lib.llama_state_set_data(llm._ctx.ctx, arr, len(state)) != len(state):
            raise RuntimeError("llama_state_set_data failed")
        llm.input_ids[: len(saved)] = saved
        llm.n_tokens = len(saved)
        llm._requires_eval = True
        return best_n

    def bytes(self) -> int:
        return sum(len(s) for _, s in self.items)


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    t_load = time.perf_counter()
    llama_cpp, llm = load(job)
    load_s = time.perf_counter() - t_load
    stop = set(job.get("stop_ids", [])) | {llm.token_eos()}
    new = job["new_tokens"]
    out: dict = {"llama_cpp_python": llama_cpp.__version__, "load_s": round(load_s, 2), "model": loaded(llm),
                 "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
                 "n_ctx": job["n_ctx"], "threads": job["threads"]}
    # one untimed warm-up generation, so that neither mode pays first-call costs
    llm.reset()
    generate(llm, job["prompts"][0]["ids"][:64], 2, stop)

    for mode in job["modes"]:
        rows = []
        if mode == "full":
            for i, p in enumerate(job["prompts"]):
                for rep in range(p.get("reps", 1)):
                    llm.reset()
                    llm._ctx.kv_cache_clear()
                    r = generate(llm, p["ids"], new, stop)
                    r.update(prompt=i, rep=rep, reused_tokens=0, prefilled_tokens=len(p["ids"]))
                    rows.append(r)
                    print(f"llama.cpp full [{i + 1}/{len(job['prompts'])}] {len(p['ids'])} tokens "
                          f"{r['ttft_ms']:.0f} ms", file=sys.stderr, flush=True)
        elif mode == "prefix":
            llm.reset()
            llm._ctx.kv_cache_clear()
            cache = StateCache(llama_cpp, llm)
            t = time.perf_counter()
            for w in job.get("warm", []):
                generate(llm, w, 1, stop)
                cache.save(w)
            warm_s = time.perf_counter() - t
            for i, p in enumerate(job["prompts"]):
                t0 = time.perf_counter()
                reused = cache.restore_best(p["ids"])
                restore_ms = (time.perf_counter() - t0) * 1000
                r = generate(llm, p["ids"], new, stop)
                r["ttft_ms"] = round(r["ttft_ms"] + restore_ms, 2)
                reused = min(reused, len(p["ids"]) - 1)  # generate re-evaluates one token of a full match
                r.update(prompt=i, reused_tokens=reused, prefilled_tokens=len(p["ids"]) - reused,
                         restore_ms=round(restore_ms, 2))
                cache.save(p["ids"])
                rows.append(r)
                print(f"llama.cpp prefix [{i + 1}/{len(job['prompts'])}] reused {reused}/{len(p['ids'])} "
                      f"{r['ttft_ms']:.0f} ms", file=sys.stderr, flush=True)
            out["prefix_warm_s"] = round(warm_s, 2)
            out["prefix_state_bytes"] = cache.bytes()
        else:
            raise SystemExit(f"unknown mode {mode!r}: full or prefix")
        for r in rows:
            r["text"] = llm.detokenize(r["generated"]).decode("utf-8", errors="replace")
        out[mode] = rows
    print(json.dumps(out))


if __name__ == "__main__":
    main()
