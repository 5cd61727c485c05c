"""The benchmarks' Markdown tables as data: one spec per table, and the one function that renders a spec.

A spec is JSON: ``columns`` is a list of ``[header, align, cell, *fallbacks]``, where ``align`` is ``l``, ``r`` or
``c`` and ``cell`` a :meth:`str.format` template over one row (``{ttft_ms[median]:.0f} ms``). A cell whose template
names a missing key or a None value takes the first fallback that renders. Conversions scale a number before its
format: ``!k`` divides by 1000 (ms to s), ``!M`` by 2**20 (bytes to MiB), ``!G`` by 1e9. A column whose header holds
``{each}`` repeats once per item of the list ``each`` (the spec's own, or the renderer's), ``{each}`` replaced in
its cell. A spec with ``rows`` is a table of labelled lines over one document: each ``[label, cell]`` a row, left
out when its cell cannot render.

Every bench script's result JSON carries the specs of the tables drawn from it (``tables``, written by
bench/common.py ``emit`` from :data:`BY_SCRIPT`); bench/report.py renders a file's own specs and falls back to
:data:`TABLES` for results written before they carried any. No import beyond the standard library: this module is
read by the report and by every bench script.
"""

from __future__ import annotations

import string

SCALES = {"k": 1000, "M": 2**20, "G": 1e9}
ALIGN = {"l": "---|", "r": "---:|", "c": ":-:|"}
CI = "{ci95[0]:.0%}–{ci95[1]:.0%}"
SPREAD_MS = "{ttft_ms[median]:.0f} ms ({ttft_ms[min]:.0f}–{ttft_ms[max]:.0f})"
MIN_MED_MAX_MS = "{ttft_ms[min]:.0f} ms / {ttft_ms[median]:.0f} ms / {ttft_ms[max]:.0f} ms"


class Missing(Exception):
    """A template named a value the row does not have."""


class Cells(string.Formatter):
    """str.format with the scale conversions, and a None value refused (so that a fallback is taken)."""

    def convert_field(self, value, conversion):
        if conversion in SCALES:
            return None if value is None else value / SCALES[conversion]
        return super().convert_field(value, conversion)

    def format_field(self, value, spec):
        if value is None:
            raise Missing
        return super().format_field(value, spec)


CELLS = Cells()
FAILED = (KeyError, IndexError, TypeError, ValueError, Missing)


def fill(template: str, values) -> str:
    """One template over a mapping of values (a row, or a result document with what the report adds)."""
    return CELLS.vformat(template, (), values)


def cell(options: list[str], row) -> str:
    """The first of a column's templates that renders for this row."""
    for template in options[:-1]:
        try:
            return fill(template, row)
        except FAILED:
            continue
    return fill(options[-1], row)


def columns(spec: dict, each: list[str] | None) -> list[list[str]]:
    out = []
    for col in spec["columns"]:
        items = (each if each is not None else spec.get("each", [])) if "{each}" in col[0] else [None]
        out += [[c.replace("{each}", item) for c in col] if item is not None else col for item in items]
    return out


def render(spec: dict, rows: list, each: list[str] | None = None, **head) -> list[str]:
    """The table's lines: the header (its templates filled from ``head``), the alignment row, one line per row (a
    row that is a string is written as it is: a line saying why a row has no values)."""
    if "rows" in spec:
        return labelled(spec, rows)
    cols = columns(spec, each)
    out = ["| " + " | ".join(fill(c[0], head) for c in cols) + " |", "|" + "".join(ALIGN[c[1]] for c in cols)]
    return out + [r if isinstance(r, str) else "| " + " | ".join(cell(c[2:], r) for c in cols) + " |" for r in rows]


def labelled(spec: dict, doc: dict) -> list[str]:
    cols = spec["columns"]
    out = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "".join(ALIGN[c[1]] for c in cols)]
    for label, template in spec["rows"]:
        try:
            out.append(f"| {fill(label, doc)} | {fill(template, doc)} |")
        except FAILED:
            continue
    return out


def spec(doc: dict | None, name: str) -> dict:
    """The spec a result file carries for table ``name``, else the one written here."""
    return ((doc or {}).get("tables") or {}).get(name) or TABLES[name]


FOUND_BOLD = ["found", "r", "**{accuracy:.0%}** ({found}/{n})"]
AGREES = ["first token agrees", "r", "{first_token_agreement:.0%}", "—"]
MEAN_KL = ["mean first-token KL", "r", "{mean_first_token_kl:.3f}", "—"]

TABLES: dict[str, dict] = {
    "arms": {"columns": [  # one fidelity set, per arm (bench/fidelity.py summary)
        ["arm", "l", "{label}"], ["needle found", "r", FOUND_BOLD[2]], ["95 % CI", "r", CI], AGREES, MEAN_KL,
        ["TTFT median (min–max)", "r", SPREAD_MS],
        ["TTFT × isolated, median (min–max)", "r",
         "{ttft_vs_isolated[median]:.2f}× ({ttft_vs_isolated[min]:.2f}–{ttft_vs_isolated[max]:.2f})", "{no_ratio}"],
        ["recomputed tokens", "r", "{recomputed_tokens:.0f}"]]},
    "confusable": {"columns": [  # the confusable set, per arm, with the TTFT ratio to `prefixed` on each prompt
        ["arm", "l", "{label}"], FOUND_BOLD, ["95 % CI", "r", CI], ["confused", "r", "{confused}"], AGREES, MEAN_KL,
        ["TTFT median (min–max)", "r", SPREAD_MS],
        ["TTFT × prefixed, median (min–max)", "r",
         "{vs_prefixed[median]:.2f}× ({vs_prefixed[min]:.2f}–{vs_prefixed[max]:.2f})", "—"],
        ["recomputed tokens", "r", "{recomputed_tokens:.0f}"]]},
    "samples": {"columns": [  # one column per sample arm
        ["sample", "l", "{name}"], ["`{each}`", "r", "{arms[{each}][kl]:.3f}{arms[{each}][mark]}"]]},
    "probe": {"columns": [
        ["arm", "l", "{label}"], ["recomputed tokens", "r", "{recomputed_tokens}"],
        ["TTFT median", "r", "{median_ms:.0f} ms"],
        ["TTFT min", "r", "{min_ms:.0f} ms"],
        ["× isolated, median (min–max)", "r", "{ratio_median:.2f}× ({ratio_min:.2f}–{ratio_max:.2f})"]]},
    "needles_per_precision": {"columns": [
        ["weights", "l", "`{weights}`"],
        ["single facts found (95 % CI)", "r",
         "{single[found]}/{single[n]} ({single[ci95][0]:.0%}–{single[ci95][1]:.0%})"],
        ["confusable facts found (95 % CI)", "r",
         "{confusable[found]}/{confusable[n]} ({confusable[ci95][0]:.0%}–{confusable[ci95][1]:.0%})"],
        ["command", "l", "`{command}`"]]},
    "ttft": {"columns": [
        ["prompt tokens", "r", "{prompt_tokens}"], ["cached", "r", "{cached_tokens}"],
        ["uncached", "r", "{uncached_tokens}"], ["baseline TTFT", "r", "{baseline_ttft_ms!k:.2f} s"],
        ["cached TTFT", "r", "{cached_ttft_ms:.0f} ms"], ["of which KV copy", "r", "{cached_copy_ms:.1f} ms"],
        ["speedup (range over reps)", "r", "**{speedup:.1f}×** ({speedup_min:.1f}–{speedup_max:.1f}×)"],
        ["floor: stock forward over a DynamicCache (min–max)", "r",
         "{floor_ms:.0f} ms ({floor_ms_min:.0f}–{floor_ms_max:.0f})"],
        ["cached / floor", "r", "**{cached_over_floor:.2f}**"], ["floor / no cache", "r", "{floor_over_nocache:.2f}"]]},
    "ttft_no_floor": {"columns": [  # bench/ttft.py before it timed the floor
        ["prompt tokens", "r", "{prompt_tokens}"], ["cached", "r", "{cached_tokens}"],
        ["uncached", "r", "{uncached_tokens}"], ["baseline TTFT", "r", "{baseline_ttft_ms!k:.2f} s"],
        ["cached TTFT", "r", "{cached_ttft_ms:.0f} ms"], ["of which KV copy", "r", "{cached_copy_ms:.1f} ms"],
        ["speedup", "r", "**{speedup:.1f}×**"],
        ["decode ms/token baseline / cached", "r",
         "{baseline_decode_ms_per_token:.0f} / {cached_decode_ms_per_token:.0f}"]]},
    "gpu": {"columns": [  # bench/ttft.py on a GPU, one row per length and storage
        ["prompt tokens", "r", "{prompt_tokens:,}"], ["modules in", "l", "{where}"],
        ["baseline TTFT", "r", "{baseline_ttft_ms:.1f} ms"], ["cached TTFT", "r", "{cached_ttft_ms:.1f} ms"],
        ["of which copy", "r", "{cached_copy_ms:.1f} ms"],
        ["speedup (min–max)", "r", "{speedup:.2f}× ({speedup_min:.2f}–{speedup_max:.2f})"],
        ["floor (stock transformers)", "r", "{floor_ms:.1f} ms"],
        ["question tokens alone, no cache", "r", "{nocache_ms:.1f} ms"],
        ["decode ms/token", "r", "{baseline_decode_ms_per_token:.0f}"]]},
    "gpu_paths": {"columns": [  # the same prompts with the GPU paths off (--eager-too), then on
        ["prompt tokens", "r", "{on[prompt_tokens]:,}"], ["modules in", "l", "{where}"],
        ["baseline TTFT, off → on", "r", "{off[baseline_ttft_ms]:.1f} → {on[baseline_ttft_ms]:.1f} ms"],
        ["cached TTFT, off → on", "r", "{off[cached_ttft_ms]:.1f} → {on[cached_ttft_ms]:.1f} ms"],
        ["of which copy, off → on", "r", "{off[cached_copy_ms]:.1f} → {on[cached_copy_ms]:.1f} ms"],
        ["speedup, off → on", "r", "{off[speedup]:.2f}× → {on[speedup]:.2f}×"],
        ["decode ms/token, off → on", "r",
         "{off[baseline_decode_ms_per_token]:.1f} → {on[baseline_decode_ms_per_token]:.1f}"]]},
    "profile": {"each": ["shipped", "layerwise-eager", "copy-then-graph", "resident", "resident-eager"], "columns": [
        ["prompt tokens", "r", "{prompt_tokens:,}"], ["GB copied", "r", "{copies[bytes]!G:.2f}"],
        ["one copy", "r", "{copies[one_copy_ms][median]:.1f} ms, {copies[one_copy_gb_s]:.0f} GB/s"],
        ["DMA copies (host time)", "r", "{copies[run_copies_2d_dma_ms][median]:.1f} ms, "
         "{copies[run_copies_2d_dma_gb_s]:.0f} GB/s ({copies[run_copies_2d_dma_enqueue_ms]:.1f} ms)"],
        ["torch copies (host time)", "r",
         "{copies[run_copies_ms][median]:.1f} ms ({copies[run_copies_enqueue_ms]:.1f} ms)"],
        ["{each}", "r", "{ways_ms[{each}][median]:.1f} ({ways_ms[{each}][min]:.1f}–{ways_ms[{each}][max]:.1f})"]]},
    "decode": {"columns": [
        ["weights", "l", "`{weights}`"], ["linear weights", "r", "{weight_bytes!M:,.0f} MiB"],
        ["decode ms/token, median (min–max)", "r",
         "{decode_ms_per_token[median]:.1f} ({decode_ms_per_token[min]:.1f}–{decode_ms_per_token[max]:.1f})"],
        ["modular TTFT, median", "r", "{ttft_ms[median]:.0f} ms"],
        ["first-token KL vs fp32, mean", "r", "{kl_mean:.4f}", "—"],
        ["same greedy text as fp32", "r", "{same_text}/{prompts}", "—"]]},
    "prefill": {"columns": [  # one studio column per prefill kernel measured
        ["tokens", "r", "{tokens:,}"],
        ["studio `{each}`", "r",
         "{studio[{each}][median]:.2f} s ({studio[{each}][min]:.2f}–{studio[{each}][max]:.2f})"],
        ["llama.cpp (flash attn)", "r", "{llama_cpp[median]:.2f} s", "—"],
        ["bf16 GEMM floor", "r", "{floors[bfloat16]:.2f} s", "—"],
        ["fp32 GEMM floor (MKL)", "r", "{floors[float32]:.2f} s", "—"],
        ["fp32 GEMM floor (oneDNN)", "r", "{floors[float32-onednn]:.2f} s", "—"],
        ["int8 GEMM floor", "r", "{floors[int8]:.2f} s", "—"],
        ["linears in the prefill", "r", "{linear_s:.2f} s", "—"],
        ["the rest (attention, norms, copies)", "r", "{nonlinear_s:.2f} s", "—"],
        ["attention alone (fp32 SDPA, causal)", "r", "{attention_s:.2f} s", "—"],
        ["prefill / floor used", "r", "{over_floor}×", "—×"],
        ["prefill / fastest floor", "r", "{over_fastest}× ({fastest})", "—×"]]},
    "prefill_profile": {"columns": [["where the time goes", "l", "{group}"], ["self time", "r", "{s:.2f} s"],
                                    ["share", "r", "{share:.0%}"]]},
    "browser": {"columns": [["what", "l"], ["measured", "r"]], "rows": [
        ["`python app.py` started → HTTP 200", "{serve_s:.1f} s"],
        ["first Compare (click → run logged and shown; model loaded in the background, modules encoded)",
         "{first_compare_s:.1f} s"],
        ["later Compares, min / median / max",
         "{later_compare_s[min]:.2f} / {later_compare_s[median]:.2f} / {later_compare_s[max]:.2f} s"],
        ["decode ms per step at {tokens} tokens, studio (median, min–max)",
         "{studio_decode_ms_per_token[median]:.1f} ({studio_decode_ms_per_token[min]:.1f}–"
         "{studio_decode_ms_per_token[max]:.1f})"],
        ["decode ms per step at {tokens} tokens, `pml-studio run` (median, min–max)",
         "{cli_decode_ms_per_token[median]:.1f} ({cli_decode_ms_per_token[min]:.1f}–"
         "{cli_decode_ms_per_token[max]:.1f})"],
        ["studio / run (medians)", "{studio_over_cli:.2f}×"],
        ["studio / run, pair by pair (min / median / max)", "{studio_over_cli_paired[min]:.2f} / "
         "{studio_over_cli_paired[median]:.2f} / {studio_over_cli_paired[max]:.2f}"],
        ["CPU time the host took (steal), min / median / max",
         "{steal_pct[min]} / {steal_pct[median]} / {steal_pct[max]} %"]]},
    "first_compare": {"columns": [
        ["model", "l", "{model}"], ["dtype", "l", "{dtype}"], ["load", "r", "{load_s:.1f} s"],
        ["first Compare", "r", "{first_compare_s:.1f} s"],
        ["later Compare", "r",
         "{later_compare_s[median]:.1f} s ({later_compare_s[min]:.1f}–{later_compare_s[max]:.1f})"],
        ["tokens per arm", "r", "{tokens}"], ["modular answer = baseline", "r", "{same}"],
        ["meets the bar", "c", "{meets}"]]},
    "spanning": {"columns": [
        ["set", "l", "{kind}"], ["modules", "l", "{modules}"], ["phrasing", "l", "{phrasing}"], ["arm", "l", "`{arm}`"],
        ["found", "l", "{accuracy:.0%} ({found}/{n}, " + CI + ")"], ["recall", "l", "{recall:.0%}", "–"],
        ["TTFT × baseline", "l", "{ratio:.2f}{ref}", "–"]]},
    "serve": {"columns": [
        ["configuration", "l", "{name}"], ["TTFT min / median / max", "l", MIN_MED_MAX_MS],
        ["mean TTFT", "r", "{mean_ttft_ms:.0f} ms", "—"], ["× llama.cpp", "r", "{vs_llama:.2f}", "–"],
        ["last token (median)", "r", "{last_token_ms[median]:.0f} ms", "—"],
        ["decode ms/token", "r", "{decode_ms_per_token[median]}"], ["found", "r", "{found}/{of}"],
        ["cached / document tokens", "r", "{cached_share_of_documents[median]:.2f}", "–"]]},
    "load": {"columns": [
        ["server", "l", "{server}"], ["clients", "r", "{clients}"], ["output tokens/s", "r", "{output_tokens_per_s:.1f}"],
        ["TTFT p50 / p95 / max", "l", "{ttft_ms[p50]:.0f} / {ttft_ms[p95]:.0f} / {ttft_ms[max]:.0f} ms"],
        ["between tokens p50 / p95 / max", "l", "{itl_ms[p50]:.0f} / {itl_ms[p95]:.0f} / {itl_ms[max]:.0f} ms", "–"],
        ["found", "r", "{found}/{questions}"], ["as alone", "r", "{same_as_alone}/{requests}"]]},
    "vllm_reuse": {"columns": [
        ["set", "l", "{set}"], ["arm", "l", "{arm}"], ["mean TTFT", "r", "{mean_ttft_ms:.0f} ms", "—"],
        ["min / median / max", "l", MIN_MED_MAX_MS], ["found", "r", "{found}/{of}"],
        ["prompt reused (median)", "r", "{reused_share[median]:.0%}"]]},
    "replicas": {"columns": [
        ["configuration", "l", "{name}"], ["prompt tokens cached", "r", "**{cached_share:.0%}**"],
        ["recurring", "r", "{by_kind[recurring]:.0%}"], ["reordered", "r", "{by_kind[reordered]:.0%}"],
        ["subset", "r", "{by_kind[subset]:.0%}"], ["× one replica's", "r", "{vs_one:.2f}", "–"],
        ["TTFT p50 / p95", "r", "{ttft_ms_p50:.0f} / {ttft_ms_p95:.0f} ms"], ["found", "r", "{found}/{of}"],
        ["prompt tokens per replica", "r", "{spread}", "–"]]},
    "ape": {"columns": [["T \\ S", "l", "T = {t:.1f}"], ["S = {each}", "r", "{cells[{each}]}"]]},
    "precision_ttft": {"columns": [
        ["prompt tokens", "r", "{prompt_tokens:,}"], ["dtype", "l", "{dtype}"],
        *[[head, "r", f"{{d[{key}][median]:.0f}} ms ({{d[{key}][min]:.0f}}–{{d[{key}][max]:.0f}})"]
          for head, key in (("baseline TTFT", "baseline_ttft_ms"), ("cached TTFT", "cached_ttft_ms"),
                            ("decode ms/token", "decode_ms_per_token"))]]},
    "precision_needles": {"columns": [
        ["needles", "l", "{label}, {modules} modules"], ["arm", "l", "{arm}"],
        ["found", "r", "{accuracy:.0%} ({found}/{prompts})"], ["95 % CI", "r", CI],
        ["first-token KL vs fp32 (mean / max)", "r", "{kl_vs_fp32[mean]:.1e} / {kl_vs_fp32[max]:.1e}"],
        ["KL vs its own baseline", "r", "{kl_vs_own_baseline[mean]:.3f}"]]},
    "workload": {"columns": [
        ["arm", "l", "{name}"], ["mean TTFT", "r", "**{mean_ttft_ms:.0f} ms**"], ["p50", "r", "{p50_ttft_ms:.0f} ms"],
        ["p90", "r", "{p90_ttft_ms:.0f} ms"],
        ["prompts in schema order", "r", "{schema_order_mean_ttft_ms:.0f} ms", "—"],
        ["other prompts", "r", "{other_mean_ttft_ms:.0f} ms", "—"], ["tokens prefilled", "r", "{prefilled_tokens:,}"],
        ["needle found", "r", "{needle_found}/{n}"], ["95 % CI", "r", CI],
        ["cache bytes", "r", "{cache_bytes!M:.1f} MiB"]]},
    "peers": {"columns": [  # the workload's arms beside llama.cpp's (bench/peers.py)
        ["arm / peer", "l", "{label}"], ["mean TTFT", "r", "**{mean_ttft_ms:.0f} ms**"],
        ["min / median / max", "r", "{ttft_ms[min]:.0f} / {ttft_ms[median]:.0f} / {ttft_ms[max]:.0f} ms"],
        ["schema-order prompts", "r", "{schema_order_mean_ttft_ms:.0f} ms", "—"],
        ["other prompts", "r", "{other_mean_ttft_ms:.0f} ms", "—"],
        ["decode ms/token (median)", "r", "{decode_median:.0f}"],
        ["time to token {new_tokens}: mean (min / median / max)", "r",
         "**{to_n[mean_ms]:.0f} ms** ({to_n[min]:.0f} / {to_n[median]:.0f} / {to_n[max]:.0f})", "—"],
        ["needle found", "r", "{needle_found}/{n}"], ["95 % CI", "r", CI]]},
    "peers_lengths": {"columns": [  # one TTFT and one decode column per engine measured
        ["prompt tokens", "r", "{prompt_tokens:,}"], ["{each} TTFT", "r", "{ttft[{each}]}", "—"],
        ["studio cached TTFT (fp32)", "r", "{cached}", "—"],
        ["{each} decode ms/token", "r", "{decode[{each}]:.0f}", "—"]]},
    "kvpress": {"columns": [
        ["method", "l", "{method}"], ["kept", "r", "{kept}"], ["needle found", "r", "{needle_found}/{n}"],
        ["95 % CI", "r", CI], ["KV decoded over", "r", "{buffer_ratio:.0%}", "100%"],
        ["time, median (min–max)", "r", "{time[median]:.0f} ms ({time[min]:.0f}–{time[max]:.0f})", "—"]]},
    "compression": {"columns": [
        ["configuration", "l", "{name}"], ["stored module bytes", "r", "{bytes_ratio:.0%}", "—"],
        ["KV decoded over", "r", "{buffer_ratio:.0%}", "—"],
        ["needle found", "r", "{bold}{accuracy:.0%}{bold} ({found}/{n})"], ["95 % CI", "r", CI],
        ["first token agrees with fp32 cached", "r", "{agree_ref:.0%}", "—"],
        ["KL vs fp32 cached", "r", "{kl_ref:.4f}", "—"], ["KL vs baseline", "r", "{kl_base:.4f}", "—"]]},
    "compression_at_4k": {"columns": [
        ["configuration", "l", "{name}"],
        ["decode ms/token", "r",
         "{decode_ms_per_token[median]:.0f} ({decode_ms_per_token[min]:.0f}–{decode_ms_per_token[max]:.0f})"],
        ["vs full", "r", "{decode_ratio_to_full:.2f}×"],
        ["KV decoded over", "r", "{buffer_bytes_decoded_over!M:.0f} MiB"],
        ["stored module KV", "r", "{module_store_bytes!M:.0f} MiB"],
        ["KV copy into the buffer (in TTFT)", "r", "{copy_ms[median]:.0f} ms"]]},
    "families": {"columns": [["family", "l", "{family}"], ["runs", "c", "{runs}"], ["{each}", "c", "{marks[{each}]}"]]},
}

# Row labels: the arms, peers and engines as the tables name them
ARM_NOTES = {"baseline": "baseline (full prefill)", "prefixed": "`contextual` (default encoding; `prefixed` then)",
             "isolated": "`isolated` (the paper's scheme)", "scaffold": "scaffold over all modules"}
PEER_NAMES = {"baseline": "studio baseline (full prefill)", "prefix": "studio prefix cache (exact)",
              "cached": "studio modular cache", "llama.cpp-full": "llama.cpp, full prefill",
              "llama.cpp-prefix": "llama.cpp, prefix reuse (saved states)", "blend": "studio blend (`deviation`)"}
ENGINE_NAMES = {"float32": "studio fp32", "bfloat16": "studio bf16"}
# bench/prefill.py's GEMM floors as the tables name them, and the floor each prefill kernel's precision runs at
FLOORS = {"bfloat16": "bf16", "float32": "fp32", "float32-onednn": "fp32 oneDNN", "int8": "int8"}
KERNEL_FLOOR = {"gemm-bf16": "bfloat16", "gemm-fp32": "float32", "gemm-int8": "int8"}
KV_NAMES = {"baseline": "studio baseline (full prefill)", "cached fp32": "studio modular, full modules",
            "question": "studio `question` retention", "pyramid": "studio `pyramid` (query-agnostic control)",
            "kvpress none": "kvpress, no press (its own path)"}

# The tables each bench script's results are drawn in (bench/common.py emit writes them into the JSON)
BY_SCRIPT = {
    "fidelity": ["arms", "confusable", "samples", "probe"], "ttft": ["ttft", "gpu", "gpu_paths"],
    "gpu_profile": ["profile"], "decode": ["decode"], "prefill": ["prefill", "prefill_profile"],
    "browser_compare": ["browser"],
    "first_compare": ["first_compare"], "spanning": ["spanning"], "serve": ["serve"], "load": ["load"],
    "vllm_reuse": ["vllm_reuse"], "replicas": ["replicas"],
    "precision": ["precision_ttft", "precision_needles"], "workload": ["workload"],
    "peers": ["peers", "peers_lengths", "kvpress"], "compression": ["compression", "compression_at_4k"],
    "families": ["families"],
}


def for_script(script: str) -> dict:
    """The specs of the tables drawn from a bench script's results (``bench/ttft.py`` or ``ttft``)."""
    name = script.rsplit("/", 1)[-1].removesuffix(".py")
    return {t: TABLES[t] for t in BY_SCRIPT.get(name, [])}
