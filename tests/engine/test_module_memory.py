"""Module memory: persistence, byte budget with eviction and pinning, storage dtype, compression."""

from __future__ import annotations

import pytest
import torch

from conftest import decoded_fully, first_token_kl
from engine.config import Compression
from engine.cache.compress import compress
from engine.errors import EngineError, StorageError
from engine.kv import LayeredKV, ModuleKV
from engine.model.attend import _pml_attention
from engine.arms.registry import Sampling
from engine.session import Engine

DOCS = ("The red fox jumps over the lazy dog near the river bank every single morning before sunrise.",
        "Quantum computers use qubits that can hold superpositions of states and entangle with each other.",
        "The library opens at nine and closes at five on weekdays, and at noon on Saturdays.")
SCHEMA = """<schema name="mem">
  <system>You answer questions about the documents.</system>
  <user>
    <module name="d1">{0}</module>
    <module name="d2">{1}</module>
    <module name="d3">{2}</module>
  </user>
</schema>""".format(*DOCS)
PROMPT = "<prompt schema='mem'><d1/><d2/><d3/> Which animal jumps?</prompt>"


def engine(tiny_lm, tmp_path=None, **options) -> Engine:
    if tmp_path is not None:
        options.update(persist=True, module_dir=tmp_path / "modules")
    return Engine.from_loaded(tiny_lm, **options)


def sources(enc) -> set[str]:
    return {u.source for u in enc.encoded.units}


def same_as_memory_only(tiny_lm, c, prompt: str = PROMPT, n: int = 3) -> bool:
    """``c``'s cached run equals the one of an engine that keeps modules in memory only, with no budget."""
    ref = engine(tiny_lm).compare(SCHEMA, prompt, Sampling(n))
    return torch.allclose(c.cached.first_logits, ref.cached.first_logits, atol=1e-6) and \
        c.cached.token_ids == ref.cached.token_ids


def test_restart_encodes_nothing(tiny_lm, tmp_path):
    first = engine(tiny_lm, tmp_path)
    a = first.compare(SCHEMA, PROMPT, Sampling(4))
    assert sources(first.encode(first.layout(SCHEMA))) == {"memory"}
    files = sorted((tmp_path / "modules").glob("*.safetensors"))
    assert len(files) == 4  # anonymous + 3 modules, each written once
    restarted = engine(tiny_lm, tmp_path)  # a new process would see the same folder
    enc = restarted.encode(restarted.layout(SCHEMA))
    assert sources(enc) == {"disk"} and enc.reused
    b = restarted.compare(SCHEMA, PROMPT, Sampling(4))
    assert torch.equal(a.cached.first_logits, b.cached.first_logits)
    assert a.cached.token_ids == b.cached.token_ids


def test_corrupted_or_truncated_file_is_re_encoded(tiny_lm, tmp_path):
    engine(tiny_lm, tmp_path).encode(engine(tiny_lm).layout(SCHEMA))
    files = sorted((tmp_path / "modules").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    victim, garbled = files[-1], files[-2]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated
    data = bytearray(garbled.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the tensor data
    garbled.write_bytes(bytes(data))
    eng = engine(tiny_lm, tmp_path)
    enc = eng.encode(eng.layout(SCHEMA))
    assert [u.source for u in enc.encoded.units].count("encoded") == 2
    assert eng.store().disk.corrupt == 2 and "re-encoded" in eng.store().disk.last_error
    c = eng.compare(SCHEMA, PROMPT, Sampling(3))
    assert same_as_memory_only(tiny_lm, c)  # the re-encoded entries, not the damaged files


def test_full_disk_keeps_running_in_memory(tiny_lm, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the module folder should be")
    eng = Engine.from_loaded(tiny_lm, persist=True, module_dir=blocker / "modules")
    c = eng.compare(SCHEMA, PROMPT, Sampling(3))
    stats = eng.store().stats()
    assert stats["disk_write_errors"] == 4 and stats["disk_writes"] == 0
    assert "cannot write" in stats["disk_error"]
    assert c.store.stats["disk_write_errors"] == 4 and same_as_memory_only(tiny_lm, c)


def test_budget_smaller_than_one_module_is_refused_clearly(tiny_lm):
    eng = engine(tiny_lm, budget_bytes=1000)
    with pytest.raises(StorageError) as info:
        eng.compare(SCHEMA, PROMPT, Sampling(2))
    msg = str(info.value)
    assert "needs" in msg and "budget is" in msg and "--budget-mb" in msg


def test_budget_evicts_lru_to_disk_and_pins_the_system_prompt(tiny_lm, tmp_path):
    full = engine(tiny_lm)
    lay = full.layout(SCHEMA)
    sizes = full.encode(lay).bytes_by_module
    anon, module = sizes["(anonymous)"], max(v for k, v in sizes.items() if k != "(anonymous)")
    eng = engine(tiny_lm, tmp_path, budget_bytes=anon + 2 * module)  # room for the prefix and two modules
    enc = eng.encode(eng.layout(SCHEMA))
    store = eng.store()
    assert store.evictions >= 1 and store.nbytes() <= store.budget_bytes
    assert enc.encoded.module_keys[""] in store.pinned() and enc.encoded.module_keys[""] in store
    one_prompt = "<prompt schema='mem'><d1/> Which animal jumps?</prompt>"
    one = eng.compare(SCHEMA, one_prompt, Sampling(2))
    assert same_as_memory_only(tiny_lm, one, one_prompt, 2)  # entries back from disk hold the same KV
    with pytest.raises(StorageError) as info:  # all three modules cannot be in memory at once
        eng.compare(SCHEMA, PROMPT, Sampling(2))
    assert "needs" in str(info.value) and "at once" in str(info.value)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_storage(tiny_lm, dtype):
    full = engine(tiny_lm).compare(SCHEMA, PROMPT, Sampling(4))
    half = engine(tiny_lm, storage_dtype=dtype).compare(SCHEMA, PROMPT, Sampling(4))
    for name, size in full.store.by_module.items():
        expected = size if name == "(anonymous)" else size // 2  # the prefix stays in the compute dtype
        assert half.store.by_module[name] == expected
    assert half.store.dtype == dtype
    # rounding the stored KV to 16 bits barely moves the cached run's first-token distribution
    assert 0 < first_token_kl(full.cached, half.cached) < 1e-3
    assert half.cached.token_ids[0] == full.cached.token_ids[0]


def test_layer_ratios_average_to_the_retention():
    for r in (0.75, 0.5, 0.3):
        ratios = Compression(r, "pyramid").layer_ratios(30)
        assert sum(ratios) / 30 == pytest.approx(r, abs=1e-6)
        assert all(a >= b for a, b in zip(ratios, ratios[1:])) and ratios[0] <= 1.0  # fewer with depth
        assert Compression(r, "uniform").layer_ratios(30) == [r] * 30
    with pytest.raises(EngineError, match="retention must be in"):
        Compression(0.0)


def test_compress_keeps_scores_and_recent_window():
    torch.manual_seed(0)
    n, layers = 40, 4
    entry = ModuleKV(torch.randn(layers, 2, 2, n, 8), torch.arange(100, 100 + n), torch.arange(n))
    scores = [torch.rand(n) for _ in range(layers)]
    scores[0][3] = 10.0  # a pivotal early token
    out = compress(entry, scores, Compression(0.5, "pyramid"))
    assert isinstance(out, LayeredKV) and len(out) == n
    kept = [k.tolist() for k in out.kept]
    assert len(kept[0]) >= len(kept[-1])
    assert 3 in kept[0] and n - 1 in kept[-1]  # the top-scored token and the newest token
    assert out.kept_tokens() <= 0.5 * n * layers
    assert torch.equal(out.layers[0][:, :, 0], entry.kv[0][:, :, kept[0][0]])
    recent = compress(entry, scores, Compression(0.5, "recent"))
    assert all(k.tolist() == list(range(20, 40)) for k in recent.kept)


def test_half_the_bytes_at_half_retention_and_runs(tiny_lm):
    full = engine(tiny_lm).compare(SCHEMA, PROMPT, Sampling(3))
    for method in ("pyramid", "uniform", "recent"):
        c = engine(tiny_lm, compression=Compression(0.5, method)).compare(SCHEMA, PROMPT, Sampling(3))
        modules = [k for k in full.store.by_module if k != "(anonymous)"]
        assert sum(c.store.by_module[k] for k in modules) <= 0.52 * sum(full.store.by_module[k]
                                                                               for k in modules)
        assert c.store.compression == {"retention": 0.5, "method": method}
        assert decoded_fully(c.cached, 3, tiny_lm.eos_ids)
        assert first_token_kl(full.cached, c.cached) > 1e-9  # the run read the thinned entries, not full ones


def test_recent_window_compression_equals_the_sliced_dense_entry(tiny_lm):
    """Same kept tokens in every layer through the per-layer path == a dense entry of those tokens."""
    eng = engine(tiny_lm)
    lay = eng.layout(SCHEMA)
    plan = eng.plan(lay, "<prompt schema='mem'><d1/> Which animal?</prompt>", Sampling(1))
    enc = eng.encode(lay).encoded
    store = eng.store()
    key = enc.module_keys["d1"]
    dense = store.get(key)
    n = len(dense)
    layered = compress(dense, None, Compression(0.5, "recent"))
    from tests.arm_runs import run_cached

    store._entries[key] = layered
    a = run_cached(eng.lm, plan, enc, store)
    sliced = dense.slice(list(range(n - len(layered.kept[0]), n)))
    # a dense entry holding only the kept tokens, written where d1's tokens go
    store._entries[key] = _Padded(sliced, n)
    b = run_cached(eng.lm, plan, enc, store)
    assert torch.allclose(a.first_logits, b.first_logits, atol=1e-5)


class _Padded:
    """A dense entry that only has the last tokens of a module (test helper)."""

    def __init__(self, entry: ModuleKV, n: int):
        self.entry, self.n = entry, n

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    def write_into(self, buf, a, b):
        first = self.n - len(self.entry)
        lo, hi = max(a, first) - first, max(b, first) - first
        buf.write(self.entry.kv[:, :, :, lo:hi])


def test_pml_attention_masks_each_layer_at_its_own_length():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 10, 8)  # this layer kept 7 + 3 new keys, while layer 0 had 12 + 3
    v = torch.randn(1, 2, 10, 8)
    wrong = torch.ones(1, 1, 3, 15, dtype=torch.bool)

    class Module:
        layer_idx = 1
        num_key_value_groups = 2
        is_causal = True
        training = False

    out, _ = _pml_attention(Module(), q, k, v, wrong, scaling=8 ** -0.5)
    mask = torch.ones(3, 10, dtype=torch.bool).tril_(7)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=mask)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)


def test_an_impossible_budget_is_refused_before_the_model_loads():
    eng = Engine(budget_bytes=1024, persist=False)  # the default model: only its tokenizer and config are read
    with pytest.raises(StorageError, match="budget is"):
        eng.compare(SCHEMA, PROMPT, Sampling(2))
    assert not eng.loaded
