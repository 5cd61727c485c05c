"""The prefill GEMMs (engine/model/prefill.py): a packed model's multi-token forwards against an fp32 reference whose
linear layers are plain ``nn.Linear`` over the packed weights' own values; the fallback where the CPU has no bf16
units; and the chosen kernel in ``info`` and ``run --json``."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.model import prefill
from engine.model.load import wrap_model
from engine.model.weights import PackedLinear, PackedMLP, quantize_weights

# largest |difference| / largest |value| of a 40-token prefill's hidden states and last logits, by kernel: fp32 is the reference's own
# arithmetic (summation order aside); bf16 rounds activations and weights to 8 bits of mantissa; int8 quantizes
# activations per call, per tensor (fbgemm keeps 7 bits of range)
TOLERANCE = {"gemm-fp32": 1e-5, "gemm-bf16": 3e-2, "gemm-int8": 0.25, "blocks": 3e-2}
HEAD = 1e-2  # the packed output matrix (a decode-sized product on the blocks) adds its own rounding to the logits


def _models(tokenizer_bundle):
    """(packed int8 Qwen2, fp32 reference with the same weight values): 2 layers, q / k / v biases."""
    import transformers as T

    cfg = T.Qwen2Config(vocab_size=len(tokenizer_bundle[1]), hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        max_position_embeddings=4096, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = T.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the initial weights give, so greedy tokens are not coin tosses
        for name, p in model.named_parameters():
            p.mul_(4.0 if name.endswith("weight") and "norm" not in name else 1.0)
    reference = copy.deepcopy(model)
    quantize_weights(model, "int8")
    packed = dict(model.named_modules())
    with torch.no_grad():
        for name, m in reference.named_modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(_dense(packed, name))
    return model, reference


def _dense(packed: dict, name: str) -> torch.Tensor:
    """The values the packed model multiplies by for layer ``name`` (gate and up share one packed matrix)."""
    if name in packed and isinstance(packed[name], PackedLinear):
        return packed[name].dense()
    parent, _, leaf = name.rpartition(".")
    mlp = packed[parent]
    assert isinstance(mlp, PackedMLP)
    return mlp.gate_up.dense().split(mlp.inter)[0 if leaf == "gate_proj" else 1]


@pytest.fixture(scope="module")
def pair(tokenizer_bundle):
    model, reference = _models(tokenizer_bundle)
    return wrap_model(model, tokenizer_bundle[1], "tiny-qwen2-int8", weights="int8"), \
        wrap_model(reference, tokenizer_bundle[1], "tiny-qwen2-fp32")


def _logits(lm, ids: torch.Tensor) -> torch.Tensor:
    """(every position's final hidden state: what the prefill's linears compute, the last position's logits)."""
    with torch.inference_mode():
        hidden = lm.model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        return hidden.float(), lm.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()


def _off(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _greedy(lm, ids: torch.Tensor, n: int = 6) -> list[int]:
    with torch.inference_mode():
        out = lm.model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kernel", ["gemm-fp32", "gemm-bf16", "gemm-int8", "blocks"])
def test_each_kernel_s_prefill_matches_the_fp32_reference(pair, kernel):
    lm, reference = pair
    ids = torch.randint(5, 400, (1, 40), generator=torch.Generator().manual_seed(1))
    want = _logits(reference, ids)
    choice = prefill.use(lm.model, kernel)
    try:
        assert choice.kernel == kernel and (choice.nbytes > 0) == (kernel != "blocks")
        ran = _calls(lm.model, lambda: _logits(lm, ids))
        got = _logits(lm, ids)
        assert ran == (0 if kernel == "blocks" else 2 * 2 * 6)  # 2 forwards x 2 layers x (q, k, v, o, gate+up, down)
        assert _off(got[0], want[0]) < TOLERANCE[kernel]
        assert _off(got[1], want[1]) < TOLERANCE[kernel] + HEAD
        assert _greedy(lm, ids[:, :24]) == _greedy(reference, ids[:, :24])
    finally:
        prefill.use(lm.model, "auto")


def _calls(model, forward) -> int:
    """How many prefill GEMMs ``forward()`` calls."""
    counted = [0]
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.prefill is not None]
    for m in layers:
        inner = m.prefill

        def spy(x2, bias, inner=inner):
            counted[0] += 1
            return inner(x2, bias)
        spy.start = inner.start
        m.prefill = spy
    try:
        forward()
    finally:
        for m in layers:
            m.prefill = m.prefill.__defaults__[0]
    return counted[0]


@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_fp32_through_either_library_matches_the_reference(pair, monkeypatch, library):
    """gemm-fp32 runs each weight shape through MKL's sgemm or oneDNN's matmul, whichever measured faster; both
    keep the reference's arithmetic (summation order aside) and say which shapes went through oneDNN."""
    lm, reference = pair
    shapes = {(m.out_features, m.in_features) for m in prefill._layers(lm.model)}
    monkeypatch.setattr(prefill, "_detected", {f"fp32 {s}": (library, 1.5) for s in shapes})
    ids = torch.randint(5, 400, (1, 40), generator=torch.Generator().manual_seed(3))
    want = _logits(reference, ids)
    choice = prefill.use(lm.model, "gemm-fp32")
    try:
        assert all(m.prefill.onednn == (library == "onednn") for m in prefill._layers(lm.model))
        assert ("through oneDNN at" in choice.why) == (library == "onednn")
        assert choice.nbytes == sum(4 * m.out_features * m.in_features for m in prefill._layers(lm.model))
        got = _logits(lm, ids)
        assert _off(got[0], want[0]) < TOLERANCE["gemm-fp32"]
        assert _greedy(lm, ids[:, :24]) == _greedy(reference, ids[:, :24])
    finally:
        monkeypatch.setattr(prefill, "_detected", {})
        prefill.use(lm.model, "auto")


def test_bf16_multiplies_a_copy_laid_out_once_where_onednn_runs_bf16(pair):
    """oneDNN's blocked layout is made at load, not at every call; the product is F.linear's on the same bf16
    weight (summation order aside: one bf16 rounding step)."""
    lm, _ = pair
    choice = prefill.use(lm.model, "gemm-bf16")
    try:
        layers = prefill._layers(lm.model)
        layout = "onednn-blocked" if prefill.onednn_bf16(torch.device("cpu")) else ""
        assert {m.prefill.layout for m in layers} == {layout}
        assert choice.layout == layout  # module KV is keyed by it
        for m in layers:
            x = torch.randn(33, m.in_features, generator=torch.Generator().manual_seed(4))
            want = torch.nn.functional.linear(x.to(torch.bfloat16), m.dense().to(torch.bfloat16)).float()
            assert _off(m.prefill(x, None), want) < 2 ** -7
    finally:
        prefill.use(lm.model, "auto")


def test_the_fp32_library_is_measured_per_shape(monkeypatch):
    monkeypatch.setattr(prefill, "_detected", {})
    monkeypatch.setattr(prefill, "_time_gemm", lambda dtype, rows, shape, calls=3, linear=None:
                        1.0 if linear is prefill.onednn_linear else 2.0 if shape[0] > 100 else 1.0)
    assert prefill.fp32_library((512, 64))[0] == "onednn" and prefill.fp32_library((64, 64))[0] == "mkl"
    assert prefill.fp32_library((512, 64))[1] == 2.0


def test_a_large_shape_s_measurement_is_kept_for_the_next_load_in_a_private_file(monkeypatch, tmp_path):
    monkeypatch.setenv("PML_STUDIO_CACHE", str(tmp_path / "cache"))
    measured = []

    def measure(shape):
        measured.append(shape)
        return 1.7

    big, small = (4096, 1024), (64, 64)
    assert prefill._remembered(big, measure) == prefill._remembered(big, measure) == 1.7
    assert prefill._remembered(small, measure) == 1.7 and measured == [big, small]  # a small one is not kept
    kept = tmp_path / "cache" / "packed" / "fp32-library.json"
    assert kept.stat().st_mode & 0o777 == 0o600 and "4096x1024" in kept.read_text()
    kept.write_text("{not json")  # a damaged file is measured again and rewritten
    assert prefill._remembered(big, measure) == 1.7 and measured[-1] == big and "4096x1024" in kept.read_text()


def test_without_onednn_fp32_stays_on_mkl_without_measuring(monkeypatch):
    monkeypatch.setattr(prefill, "_detected", {})
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setattr(prefill, "_time_gemm", lambda *a: pytest.fail("timed a library torch lacks"))
    assert prefill.fp32_library((512, 64)) == ("mkl", 1.0)


def test_a_decode_step_keeps_the_packed_blocks(pair):
    lm, _ = pair
    choice = prefill.use(lm.model, "gemm-fp32")
    assert choice.kernel == "gemm-fp32"
    one = torch.tensor([[42]])
    assert _calls(lm.model, lambda: _logits(lm, one)) == 0


def test_without_bf16_units_auto_falls_back_to_fp32(pair, monkeypatch):
    lm, reference = pair
    monkeypatch.setattr(prefill, "bf16_units", lambda: "this CPU has no bf16 matrix units (forced by the test)")
    monkeypatch.setattr(prefill, "_detected", {})
    choice = prefill.use(lm.model, "auto")
    assert choice.kernel == "gemm-fp32" and "forced by the test" in choice.why
    ids = torch.randint(5, 400, (1, 32), generator=torch.Generator().manual_seed(2))
    want = _logits(reference, ids)
    assert _off(_logits(lm, ids)[0], want[0]) < TOLERANCE["gemm-fp32"]


def test_with_bf16_units_auto_measures_before_choosing(pair, monkeypatch):
    lm, _ = pair
    monkeypatch.setattr(prefill, "bf16_units", lambda: "")
    monkeypatch.setattr(prefill, "_detected", {})
    monkeypatch.setattr(prefill, "_time_gemm", lambda dtype, *a: 1.0 if dtype == torch.bfloat16 else 3.0)
    assert prefill.use(lm.model, "auto").kernel == "gemm-bf16"
    monkeypatch.setattr(prefill, "_detected", {})
    monkeypatch.setattr(prefill, "_time_gemm", lambda dtype, *a: 3.0 if dtype == torch.bfloat16 else 1.0)
    choice = prefill.use(lm.model, "auto")
    assert choice.kernel == "gemm-fp32" and "slower" in choice.why
    prefill.use(lm.model, "auto")


def test_an_unknown_kernel_is_refused_naming_the_choices(monkeypatch):
    from engine.errors import ModelError

    monkeypatch.setenv(prefill.ENV, "gemm-fp16")
    with pytest.raises(ModelError, match="PML_STUDIO_PREFILL_KERNEL.*gemm-fp32"):
        prefill.asked()


def test_the_kernel_is_in_info_and_run_json(pair, tiny_lm):
    from engine.arms.registry import Sampling
    from engine.session import Engine
    from conftest import SAMPLES

    lm, _ = pair
    assert lm.info()["prefill_kernel"] == prefill.use(lm.model, "auto").kernel
    assert tiny_lm.info()["prefill_kernel"] == "dense"  # fp32 weights: the model's own matrices
    eng = Engine.from_loaded(lm)
    schema, prompt = (SAMPLES / "travel.xml").read_text(), (SAMPLES / "travel.prompt.xml").read_text()
    doc = eng.compare(schema, prompt, Sampling(max_new_tokens=2),
                      config=eng.config.with_(arms=("baseline", "cached"))).to_json()
    assert doc["prefill_kernel"] == lm.prefill.kernel


def test_the_cli_takes_the_kernel_and_info_says_it(capsys):
    import json

    from engine.cli import main
    from engine.model import SMALL_MODEL

    try:
        assert main(["info", "--model", SMALL_MODEL, "--json", "--prefill-kernel", "blocks"]) == 0
        assert prefill.asked() == "blocks"
    finally:
        prefill.ask(None)
    doc = json.loads(capsys.readouterr().out)
    assert doc["prefill_kernel"] == "dense" and doc["prefill_weight_bytes"] == 0
    with pytest.raises(SystemExit):
        main(["info", "--prefill-kernel", "gemm-fp16"])


@pytest.mark.real_model
def test_the_real_model_s_answers_are_kept_on_packed_weights():
    """SmolLM2 on int8 weights: the doc_qa sample's baseline with the auto prefill kernel against the packed blocks
    (today's path): the same greedy tokens, first-token KL under 0.01."""
    from conftest import SAMPLES
    from engine.arms.registry import Sampling
    from engine.model import SMALL_MODEL
    from engine.model.load import load_model
    from engine.session import Engine

    lm = load_model(SMALL_MODEL, weights="int8")
    assert lm.prefill.kernel.startswith("gemm-") and lm.prefill.nbytes > 0
    schema, prompt = (SAMPLES / "doc_qa.xml").read_text(), (SAMPLES / "doc_qa.prompt.xml").read_text()
    runs = {}
    for kernel in (lm.prefill.kernel, "blocks"):
        prefill.use(lm.model, kernel)
        eng = Engine.from_loaded(lm)
        runs[kernel] = eng.compare(schema, prompt, Sampling(max_new_tokens=6),
                                   config=eng.config.with_(arms=("baseline",))).baseline
    new, old = runs[lm.prefill.kernel], runs["blocks"]
    assert new.prefill_tokens > 2 * prefill.GEMM_FROM and new.token_ids == old.token_ids
    p, q = old.first_logits.float().log_softmax(-1), new.first_logits.float().log_softmax(-1)
    assert float((p.exp() * (p - q)).sum()) < 0.01
