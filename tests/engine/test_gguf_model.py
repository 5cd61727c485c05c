"""GGUF files as the model (`--model path/to/file.gguf`), on tiny GGUFs written here with gguf's GGUFWriter.

A random-weight 2-layer Llama is written the way llama.cpp's converter writes one (Q and K rows
permuted for its RoPE layout, a byte-level BPE vocabulary, a ChatML template); converting it must
give back the same model. Bad files must fail with their own error and leave the cache empty: a
crafted size (SmolLM2's real GGUF rewritten with ``llama.block_count = 4000000000``) is refused from
the header, in seconds and little memory, before transformers sees it. The temporary folder of a
killed conversion is removed at the next start, and one of a live conversion is kept.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine.model import gguf, load as models, packaged, sanity
from engine.errors import ModelError
from tests.conftest import ROOT

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
BYTES = list(bytes_to_unicode().values())
TOKENS = BYTES + ["Ġt", "he", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty model cache for one test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PML_STUDIO_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a norm read from the wrong tensor would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tiny) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_gguf(path, tiny)
    return path


def write_gguf(path, model: LlamaForCausalLM, arch: str = "llama") -> None:
    """``model`` as llama.cpp's convert_hf_to_gguf.py writes it (F32 tensors)."""
    cfg = model.config
    heads, kv, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - 2) + [3, 3])  # the ChatML markers are control tokens
    w.add_token_merges(MERGES)
    w.add_eos_token_id(TOKENS.index("<|im_end|>"))
    w.add_chat_template(CHATML)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        names = {"attn_norm": "input_layernorm", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
        for gguf_name, hf in names.items():
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", sd[p + hf + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], kv))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for Q and K (its RoPE rotates interleaved pairs)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _files(root) -> list:
    return sorted(root.rglob("*")) if root.exists() else []


# -- a good file ---------------------------------------------------------------------------------

def test_a_gguf_file_converts_once_into_the_same_model(cache, gguf_file, tiny):
    name, folder = models.resolve_model_path(str(gguf_file))
    assert name == "tiny-llama" and folder.startswith(str(cache / "models" / "gguf-"))
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # the reference holds the same weights in the precision they are stored in
    reference = LlamaForCausalLM(tiny.config).eval()
    reference.load_state_dict({k: v.to(getattr(torch, gguf.GGUF_WEIGHTS_DTYPE)).float()
                               for k, v in tiny.state_dict().items()})
    ids = torch.tensor([[5, 17, 256, 257, 40, 41, 99, 200]])
    with torch.no_grad():
        got, want = converted(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_the_digest_is_remembered_and_a_changed_file_is_hashed_again(cache, gguf_file, monkeypatch):
    _, first = models.resolve_model_path(str(gguf_file))
    monkeypatch.setattr(gguf, "_file_sha256", lambda path: pytest.fail("hashed again"))
    assert models.resolve_model_path(str(gguf_file))[1] == first
    monkeypatch.undo()
    monkeypatch.setenv("PML_STUDIO_CACHE", str(cache))
    hashed = []
    real = gguf._file_sha256
    monkeypatch.setattr(gguf, "_file_sha256", lambda path: hashed.append(path) or real(path))
    st = gguf_file.stat()
    import os

    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert models.resolve_model_path(str(gguf_file))[1] == first  # same content, same folder
    assert hashed == [gguf_file.resolve()]


def test_the_engine_runs_a_gguf_file_with_its_chat_template(cache, gguf_file):
    from engine.arms.registry import Sampling
    from engine.session import Engine

    eng = Engine(model=str(gguf_file), persist=False)
    assert eng.tokenizer.decode(eng.codec.role_open["user"]) == "<|im_start|>user\n"
    schema = "<schema name='s'><system>the</system><user><module name='m'>the the</module></user></schema>"
    c = eng.compare(schema, "<prompt schema='s'><m/> the</prompt>", Sampling(3))
    assert eng.info()["model"] == "tiny-llama"
    assert c.agreement().first_token_kl < 1e-6  # one module at the prompt's start (prefixed): exact


# -- bad input: its own error, and nothing written ----------------------------------------------------

def test_a_file_that_is_not_a_gguf_is_refused(cache, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip file, not a model" * 10)
    with pytest.raises(ModelError, match="not a GGUF file"):
        models.resolve_model_path(str(bad))
    assert _files(cache) == []


def test_a_truncated_gguf_is_refused(cache, tmp_path, gguf_file):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size // 2])
    with pytest.raises(ModelError, match="truncated"):
        models.resolve_model_path(str(cut))
    assert _files(cache) == []


def test_an_architecture_transformers_cannot_load_is_refused_with_the_list(cache, tmp_path, tiny):
    path = tmp_path / "rwkv.gguf"
    write_gguf(path, tiny, arch="rwkv7")
    with pytest.raises(ModelError, match="'rwkv7' model") as info:
        models.resolve_model_path(str(path))
    assert "llama" in str(info.value) and "qwen2" in str(info.value)
    assert _files(cache) == []


def test_a_gguf_too_large_for_memory_is_refused_before_loading(cache, gguf_file, monkeypatch):
    monkeypatch.setattr(gguf, "available_bytes", lambda device: 1000)  # the file's own check, before any config
    monkeypatch.setattr(gguf, "convert_gguf", lambda *a: pytest.fail("loaded"))
    with pytest.raises(ModelError, match="memory to convert"):
        models.resolve_model_path(str(gguf_file))
    assert _files(cache) == []


def test_a_missing_gguf_path_says_so(cache):
    with pytest.raises(ModelError, match="does not exist"):
        models.resolve_model_path("no-such-model.gguf")


# -- a crafted GGUF: its sizes are checked before transformers sees them ------------------------------

MEASURE = """
import json, sys, time
import engine.session, studio.cli  # imported before the clock starts: the refusal is measured, not Python's start

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current VmRSS
except OSError:
    pass
before, start = status("VmRSS"), time.perf_counter()
rc = studio.cli.main(["info", "--model", sys.argv[1]])
print(json.dumps({"seconds": time.perf_counter() - start, "growth": status("VmHWM") - before}))
sys.exit(rc)
"""


def smollm2_gguf() -> Path:
    """The default model's GGUF inside its package (found, never imported: its __init__ imports extras)."""
    spec = importlib.util.find_spec(packaged.GGUF_PACKAGE)
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


def copy_with_field(src: Path, out: Path, key: str, value) -> Path:
    """``src`` written again with gguf's GGUFReader/GGUFWriter, metadata ``key`` set to ``value`` (its type kept);
    every other field and every tensor as they were."""
    reader = GGUFReader(src)
    assert key in reader.fields
    writer = GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value if field.name == key else field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return out


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> Path:
    """SmolLM2's real GGUF (tokenizer, tensors) with llama.block_count = 4,000,000,000."""
    out = copy_with_field(smollm2_gguf(), tmp_path_factory.mktemp("crafted") / "crafted.gguf", "llama.block_count",
                          4_000_000_000)
    arch, sizes = gguf._header_sizes(out)
    assert (arch, sizes) == ("llama", {**gguf._header_sizes(smollm2_gguf())[1], "num_hidden_layers": 4_000_000_000})
    return out


def _snapshot(root: Path) -> dict:
    """Every path under ``root`` with its content's sha256 (None for a folder)."""
    return {p.relative_to(root).as_posix(): None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def test_a_crafted_block_count_is_refused_quickly_in_little_memory_by_the_cli(cache, crafted):
    (cache / "models" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    (cache / "models" / "SmolLM2-135M-Instruct" / "config.json").write_text('{"model_type": "llama"}')
    (cache / "models" / "gguf-digests.json").write_text('{"/elsewhere.gguf": {"size": 1, "mtime_ns": 2, '
                                                        '"sha256": "ab"}}')
    before = _snapshot(cache)
    done = subprocess.run([sys.executable, "-c", MEASURE, str(crafted)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PML_STUDIO_CACHE": str(cache)}, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith(f"pml-studio: error: {crafted}: metadata field llama.block_count is 4,000,000,000")
    assert "from 1 to 10,000" in message and "convert_hf_to_gguf.py" in message
    measured = json.loads(done.stdout)
    assert measured["seconds"] <= 10 and measured["growth"] < 2**30, measured
    assert _snapshot(cache) == before  # nothing written, renamed or removed


def test_a_crafted_size_never_reaches_transformers(cache, crafted, monkeypatch):
    import transformers

    def touched(*args, **kwargs):
        pytest.fail("transformers or gguf's reader saw the crafted file")

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", touched)
    monkeypatch.setattr("gguf.GGUFReader", touched)
    with pytest.raises(ModelError, match=r"llama\.block_count is 4,000,000,000"):
        models.resolve_model_path(str(crafted))
    assert _files(cache) == []


@pytest.mark.parametrize("key, value, shown", [("llama.embedding_length", 1 << 30, "1,073,741,824"),
                                               ("llama.attention.head_count", 0, "0"),
                                               ("llama.vocab_size", 1 << 31, "2,147,483,648")])
def test_other_insane_sizes_name_their_field(cache, tmp_path, tiny, key, value, shown):
    src = tmp_path / "tiny.gguf"
    write_gguf(src, tiny)
    with pytest.raises(ModelError, match=rf"{key.replace('.', '[.]')} is {shown}, but"):
        models.resolve_model_path(str(copy_with_field(src, tmp_path / "bad.gguf", key, value)))
    assert _files(cache) == []


def test_the_converted_config_is_checked_before_any_model_is_built(cache, gguf_file, monkeypatch):
    import transformers

    monkeypatch.setattr(sanity, "available_bytes", lambda device: 1000)  # the weights no longer fit
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", lambda *a, **k: pytest.fail("built before the check"))
    with pytest.raises(ModelError, match=f"model '{gguf_file}' needs about"):
        gguf.convert_gguf(gguf_file, cache / "models" / "gguf-0123456789abcdef")
    assert _files(cache) == []


# -- temporary folders of killed conversions --------------------------------------------------------------

KILLED = """
import os, sys
from pathlib import Path
from engine.model.gguf import conversion_dir

tmp = conversion_dir(Path(sys.argv[1]))
(tmp / "model.safetensors").write_bytes(b"w" * 4096)
os.kill(os.getpid(), 9)  # as the OOM killer or a closed terminal would
"""


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def _start_with_a_gguf_file(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ModelError, match="not a GGUF file"):
        models.resolve_model_path(str(bad))  # the sweep runs before the file is even read


def _start_with_the_packaged_model(tmp_path) -> None:
    assert packaged.ensure_packaged(packaged.DEFAULT_MODEL) == packaged.default_model_dir()


@pytest.mark.parametrize("start", [_start_with_a_gguf_file, _start_with_the_packaged_model])
def test_a_killed_conversion_leaves_a_folder_the_next_start_removes(cache, tmp_path, monkeypatch, start):
    monkeypatch.setattr(packaged.Packaged, "converted", lambda self: True)  # the packaged start converts nothing
    target = cache / "models" / "gguf-0123456789abcdef"
    killed = subprocess.run([sys.executable, "-c", KILLED, str(target)], cwd=ROOT, capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    (left,) = (cache / "models").iterdir()
    assert left.name.startswith(f".{target.name}.converting-") and (left / "model.safetensors").exists()
    running = gguf.conversion_dir(target)  # a conversion under way in a live process (this one)
    start(tmp_path)
    assert list((cache / "models").iterdir()) == [running]


def test_only_the_folders_of_dead_conversions_are_removed(cache):
    import time

    folder = cache / "models"
    host = gguf._HOST
    other = "0" * 8 if host != "0" * 8 else "1" * 8
    names = {"dead": f".gguf-0123456789abcdef.converting-{host}-{_dead_pid()}-ab12cd34",
             "live": f".gguf-0123456789abcdef.converting-{host}-{os.getpid()}-ab12cd34",
             "other host, recent": f".SmolLM2-135M-Instruct.gguf.converting-{other}-1-x",
             "other host, stale": f".gguf-0123456789abcdef.converting-{other}-1-y",
             "previous version, recent": ".gguf-0123456789abcdef.k2j3h4l5",
             "previous version, stale": ".SmolLM2-135M-Instruct.k2j3h4l5",
             "not a conversion's, stale": ".trash", "a converted model, stale": "gguf-0123456789abcdef"}
    for key, name in names.items():
        (folder / name).mkdir(parents=True)
        if key.endswith("stale"):  # unchanged for longer than STALE_AFTER_S
            past = time.time() - gguf.STALE_AFTER_S - 60
            os.utime(folder / name, (past, past))
    removed = gguf.remove_stale_conversions(folder, tuple(p.name for p in packaged.PACKAGED.values()))
    gone = {"dead", "other host, stale", "previous version, stale"}
    assert sorted(p.name for p in removed) == sorted(names[k] for k in gone)
    assert sorted(p.name for p in folder.iterdir()) == sorted(n for k, n in names.items() if k not in gone)
