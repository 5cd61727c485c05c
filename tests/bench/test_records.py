"""The benchmarks' result records (bench/records.py, bench/serving.py): each ``to_json`` writes the fields and the
order the result files have always held."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from bench.common import machine, spread
from bench.page import machine_line
from bench.records import Machine, Spread
from bench.serving import StreamedAnswer, stream


def test_a_spread_keeps_the_result_files_fields():
    assert spread([3.0, 1.0, 2.555]) == {"min": 1.0, "median": 2.56, "max": 3.0, "all": [3.0, 1.0, 2.56]}
    assert spread([1.0, 2.0], 1, every=False) == {"min": 1.0, "median": 1.5, "max": 2.0}
    assert spread([]) == {"min": None, "median": None, "max": None, "all": []}
    assert Spread.of([], every=False).to_json() == {"min": None, "median": None, "max": None}


def test_a_machine_names_its_gpu_only_with_cuda():
    here = machine()
    assert list(here)[:7] == ["date", "python", "torch", "threads", "cpu", "cuda", "loadavg_1min"]
    gpu = Machine("2026-12-06", "3.12", "2.13", 16, "x86_64", True, 0.5, "NVIDIA H100")
    assert gpu.to_json()["gpu"] == "NVIDIA H100" and "gpu" not in Machine(**{**gpu.__dict__, "cuda": False}).to_json()


def test_a_machine_names_its_cpu_model_and_features_after_the_older_fields():
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    here = machine()
    assert here.get("cpu_model", "") == model
    if model:
        assert list(here)[-2:] == ["cpu_model", "cpu_features"]
        assert set(here["cpu_features"]) == {f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
                                             if f in flags}
    old = Machine("2026-12-06", "3.12", "2.13", 2, "x86_64", False, 0.5).to_json()
    assert "cpu_model" not in old and "(x86_64)" in machine_line({"machine": old})  # a file written before them
    named = Machine("2026-12-07", "3.11", "2.13", 2, "x86_64", False, 0.5, None, "AMD EPYC",
                    ("avx2", "avx512_bf16")).to_json()
    assert "2 CPU threads (AMD EPYC with avx2, avx512_bf16)" in machine_line({"machine": named})
    bare = Machine("2026-12-07", "3.11", "2.13", 2, "x86_64", False, 0.5, None, "Some CPU").to_json()
    assert "(Some CPU, none of AVX2, AVX-512 and AMX)" in machine_line({"machine": bare})


class _Client:
    """An OpenAI client's chat.completions.create, streaming the given chunks."""

    def __init__(self, chunks):
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=lambda **kw: iter(chunks)))


def _chunk(text=None, usage=None, pml=None):
    delta = SimpleNamespace(content=text)
    return SimpleNamespace(choices=[SimpleNamespace(delta=delta)] if text is not None else [], usage=usage,
                           model_extra={"pml": pml} if pml else {})


def test_a_streamed_answer_writes_the_rows_fields_in_their_order():
    usage = SimpleNamespace(prompt_tokens=40, completion_tokens=2,
                            prompt_tokens_details=SimpleNamespace(cached_tokens=32))
    pml = {"ttft_ms": 5.0, "arm_ttft_ms": 4.0, "routed_kept": ["doc1"], "modules_encoded": 0,
           "routed_out_tokens": 7, "recomputed_tokens": 3}
    answer = stream(_Client([_chunk("It is"), _chunk(" Oporto."), _chunk(usage=usage, pml=pml)]), "m", [], 8, {})
    row = answer.to_json()
    assert list(row) == ["ttft_ms", "last_ms", "chunks", "text", "decode_ms_per_token", "prompt_tokens",
                         "cached_tokens", "completion_tokens", "server_ttft_ms", "arm_ttft_ms", "routed_kept",
                         "modules_encoded", "routed_out_tokens", "recomputed_tokens", "queue_ms", "decode_batch"]
    assert row["text"] == "It is Oporto." and row["chunks"] == 2 and row["cached_tokens"] == 32
    assert row["routed_kept"] == ["doc1"] and row["recomputed_tokens"] == 3
    alone = StreamedAnswer(ttft_ms=1.0, last_ms=1.0, chunks=1, text="x").to_json()
    assert alone == {"ttft_ms": 1.0, "last_ms": 1.0, "chunks": 1, "text": "x"}  # no usage, no pml, one chunk
