"""The C++ decode step (engine/model/step.py, csrc/decode_step.cpp) against transformers' forward of the same model
over the same KV: logits and the keys and values it writes, alone and for rows of one pool decoded together (each
lease read in place, some rows' keys hidden); where it does not apply, the reason, and the decode steps fall back
to the model."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.kv import KVPool, Lease
from engine.model import kernels, step
from engine.model.attend import PLAIN, AttentionSpec, RankMask
from engine.model.weights import quantize_weights

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason=f"the engine's kernels are not built: {kernels.status()}")


def _model(family: str, kind: str, vocab: int):
    """A 2-layer random model whose every matrix tiles the engine's kernels (64-row multiples), packed as ``kind``."""
    import transformers as T

    sizes = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                 tie_word_embeddings=False, attn_implementation="sdpa")
    cfg = T.LlamaConfig(**sizes) if family == "llama" else T.Qwen2Config(**sizes)  # Qwen2: q, k, v with biases
    torch.manual_seed(0)
    model = (T.LlamaForCausalLM if family == "llama" else T.Qwen2ForCausalLM)(cfg).eval()
    with torch.no_grad():  # biases and norms away from their initial zeros and ones, so a wrong use shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    from engine.model.attend import use_pml_attention

    use_pml_attention(model)
    quantize_weights(model, kind)
    return model


@pytest.fixture(scope="module", params=[("llama", "int8"), ("qwen2", "int8"), ("qwen2", "int4"), ("llama", "int4")])
def packed(request, tokenizer_bundle):
    family, kind = request.param
    return _model(family, kind, len(tokenizer_bundle[1]) // 64 * 64), kind


def _pool(model, tokens: int = 256) -> KVPool:
    cfg = model.config
    return KVPool(cfg.num_hidden_layers, 2, 32, torch.float32, "cpu", tokens * cfg.num_hidden_layers * 2 * 2 * 32 * 4)


def _prefilled(model, n: int, first: int, seed: int, pool: KVPool, capacity: int = 64) -> Lease:
    """A lease of ``pool`` holding ``n`` random tokens at positions ``first ..``, written by the model's own forward
    (garbage before it, in its pool: a step must read no slot outside its lease)."""
    torch.manual_seed(seed)
    pool.lease(3).raw.normal_()  # a neighbour's slots, never read
    lease = pool.lease(capacity)
    ids = torch.randint(5, 400, (1, n))
    with torch.inference_mode():
        model(input_ids=ids, position_ids=torch.arange(first, first + n)[None], past_key_values=lease.cache(),
              use_cache=True)
    lease.advance(n)
    return lease


def _alone(lease: Lease) -> Lease:
    """A copy of ``lease`` in a tensor of its own."""
    other = Lease.private(torch.zeros_like(lease.data))
    other.write(lease.kv())
    return other


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to the kernels' activation rounding: a last-bit difference before a product can move a 15-bit
    activation code by one step (~6e-5 of the row's largest value); a wrong formula is off by whole percents."""
    return float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())


def _forward(model, cache, ids, pos):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([[i] for i in ids]), position_ids=torch.tensor([[p] for p in pos]),
                     past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def test_a_step_computes_the_models_forward(packed):
    model, kind = packed
    fast = step.decoder(model, kind)
    assert fast is not None, step.why_not(model, kind)
    a = _prefilled(model, 9, first=3, seed=1, pool=_pool(model))
    b = _alone(a)
    for i, tok in enumerate([17, 250, 3, 99]):
        pos = 12 + 2 * i  # gapped positions, as modules leave them
        with torch.inference_mode():
            got = fast([tok], [pos], a.base, torch.tensor([a.start]), torch.tensor([a.length]))
        a.advance(1)
        want = _forward(model, b.cache(), [tok], [pos])
        b.advance(1)
        assert got.shape == want.shape
        assert _close(got, want), i
        assert int(got.argmax()) == int(want.argmax())
    assert a.lengths == b.lengths == (13, 13)
    assert _close(a.kv(), b.kv())  # the keys (rotated) and values written, in the lease's own slots


def test_rows_of_one_pool_decoded_together_compute_each_row_alone(packed):
    """Three runs of different lengths, each in its own lease of one pool (another lease's garbage between them):
    the C++ step's rows against transformers' forward of each run alone; a row whose keys are partly hidden (a
    routed run's focus) against the forward with that mask."""
    model, kind = packed
    fast = step.decoder(model, kind)
    pool = _pool(model)
    runs = [_prefilled(model, n, first, seed, pool) for n, first, seed in [(5, 0, 2), (11, 7, 3), (8, 30, 4)]]
    alone = [_alone(r) for r in runs]
    for s in range(3):
        ids = [40 + s, 41 + s, 42 + s]
        pos = [5 + s, 18 + s, 38 + s]
        lengths = torch.tensor([r.length for r in runs])
        visible = torch.arange(16)[None, :] <= lengths[:, None]
        visible[1, 2:6] = False  # row 1 reads none of its keys 2..5
        with torch.inference_mode():
            got = fast(ids, pos, pool.data, torch.tensor([r.start for r in runs]), lengths, visible)
        for r in runs:
            r.advance(1)
        for row, other in enumerate(alone):
            mask = visible[row, : other.length + 1][None, None, None] if row == 1 else None
            with torch.inference_mode():
                want = model(input_ids=torch.tensor([[ids[row]]]), position_ids=torch.tensor([[pos[row]]]),
                             past_key_values=other.cache(), use_cache=True, logits_to_keep=1,
                             **({} if mask is None else {"attention_mask": mask})).logits[:, -1]
            other.advance(1)
            assert _close(got[row], want[0]), (s, row)


def test_where_it_does_not_apply_it_says_why(tiny_lm, monkeypatch):
    model = copy.deepcopy(tiny_lm.model)
    assert step.decoder(model, "fp32") is None
    assert "exactness reference" in step.why_not(model, "fp32")
    quantize_weights(model, "int8")  # the tiny Llama's 32-row K and V do not tile the kernels: torch's int8
    assert "not on the engine's kernels" in step.why_not(model, "int8")
    other = _model("llama", "int8", 4096)
    monkeypatch.setenv("PML_STUDIO_STEP", "0")
    assert step.why_not(other, "int8") == "turned off (PML_STUDIO_STEP=0)"


def test_contexts_that_change_attention_send_the_step_to_the_model():
    assert PLAIN.plain
    assert not AttentionSpec(keys=torch.ones(1, 1, 1, 3, dtype=torch.bool)).plain
    assert not AttentionSpec(ranks=RankMask([torch.arange(2)], torch.tensor([2]))).plain
    assert PLAIN.plain


def test_the_decode_step_uses_it_and_gives_the_models_tokens(packed, monkeypatch):
    """forward.step: the same greedy tokens through the C++ step as through the model (PML_STUDIO_STEP=0)."""
    from engine.run.forward import Row
    from engine.run.forward import step as one_step

    model, kind = packed
    lm = type("LM", (), {"model": model, "weights": kind, "device": "cpu", "attention": "pml"})()
    calls = []
    real = step.StepDecoder.__call__
    monkeypatch.setattr(step.StepDecoder, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    tokens = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PML_STUDIO_STEP", flag)
        step._made.pop(model, None)
        lease, out = _prefilled(model, 6, first=0, seed=5, pool=_pool(model)), [7]
        with torch.inference_mode():
            for i in range(6):
                out.append(int(one_step(lm, [Row(lease, out[-1], 6 + i)]).argmax()))
        tokens[flag] = out
    step._made.pop(model, None)
    assert len(calls) == 6  # every step of the first loop, none of the second
    assert tokens["1"] == tokens["0"]


def test_the_decoder_does_not_keep_its_model_alive():
    import gc
    import weakref

    model = _model("llama", "int8", 4096)
    assert step.decoder(model, "int8") is not None
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_a_focused_row_decodes_through_the_step_with_its_keys_masked(packed, monkeypatch):
    """forward.step over two rows, one of them a routed run focused on one module: the C++ step runs (its visible
    keys) and each row's logits are the model's own forward with the focus's mask, row by row."""
    from engine.model.attend import Focus
    from engine.run.forward import Row
    from engine.run.forward import step as one_step

    model, kind = packed
    lm = type("LM", (), {"model": model, "weights": kind, "device": "cpu", "attention": "pml"})()
    pool = _pool(model)
    plain, focused = _prefilled(model, 9, first=0, seed=3, pool=pool), _prefilled(model, 12, first=0, seed=4, pool=pool)
    owners = torch.tensor([-1, 0, 0, 0, 1, 1, 1, 1, 0, 0, -1, -1])  # two modules' slots, the rest no module's
    focus = Focus(owners, {7: 1})
    focus.saw(torch.tensor([[7]]))  # the answer named module 1: module 0's keys are hidden
    assert focus.focus == 1
    want = []
    for lease, spec in ((plain, PLAIN), (focused, AttentionSpec(focus=focus))):
        alone = _alone(lease)
        mask = spec.focus.visible(alone.length + 1, "cpu")[None, None, None] if spec.focus else None
        with torch.inference_mode():
            want.append(model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[alone.length]]),
                              past_key_values=alone.cache(), use_cache=True, logits_to_keep=1,
                              attn_spec=AttentionSpec(keys=mask) if mask is not None else PLAIN).logits[0, -1])
    calls = []
    real = step.StepDecoder.__call__
    monkeypatch.setattr(step.StepDecoder, "__call__", lambda self, *a: calls.append(a[-1]) or real(self, *a))
    step._made.pop(model, None)
    focus_then = Focus(owners, {7: 1})
    focus_then.focus = 1
    with torch.inference_mode():
        got = one_step(lm, [Row(plain, 7, 9), Row(focused, 7, 12, AttentionSpec(focus=focus_then))])
    step._made.pop(model, None)
    assert len(calls) == 1 and calls[0] is not None and not calls[0][1, 1:4].any()  # C++, module 0's keys hidden
    assert _close(got[0], want[0]) and _close(got[1], want[1])
    assert not _close(want[1], _forward(model, _alone(focused).cache(), [7], [12])[0])  # the mask changes the answer
