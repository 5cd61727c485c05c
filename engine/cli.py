"""`pml-studio` command line: check, layout, run, info, compile (``serve`` is added by the studio).

Front ends that sit above the engine add their own commands through ``main(argv, extra)``:
the studio's entry point (``studio/cli.py``, the ``pml-studio`` console script) adds ``serve``,
so nothing here imports the studio.

Exit codes: 0 success, 2 a problem with the input or the environment (one line per problem,
``FILE:LINE:COL: error: MESSAGE``), never a traceback. ``run --json`` prints one JSON object
whose fields are a contract for other tools: new fields may be added, none renamed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import config as cfg
from .errors import EngineError, PMLError, Problem

EXIT_OK, EXIT_INPUT = 0, 2


def build_parser(extra: dict | None = None) -> argparse.ArgumentParser:
    """The parser; ``extra`` maps command name -> (help, add_arguments(subparser), handler(args))."""
    p = argparse.ArgumentParser(prog="pml-studio", description="Modular prompt caching (PML) on your machine.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_opts(sp):
        sp.add_argument("--model", default=None, help="packaged model name, model folder, FILE.gguf (converted once) "
                        "or hub id (default: the packaged SmolLM2-135M)")

    c = sub.add_parser("check", help="validate schema and prompt files; exit 2 with one line per problem")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--schema", help="schema file to check prompts against (default: SCHEMA-NAME.xml next to them)")
    model_opts(c)

    lay = sub.add_parser("layout", help="print each module's position range and token count")
    lay.add_argument("schema", metavar="SCHEMA")
    lay.add_argument("--json", action="store_true", help="print JSON instead of a table")
    model_opts(lay)

    r = sub.add_parser("run", help="encode the schema, then run baseline and cached on the prompt and compare")
    r.add_argument("schema", metavar="SCHEMA")
    r.add_argument("prompt", metavar="PROMPT")
    add_run_options(r)
    r.add_argument("--max-new-tokens", type=int, default=32)
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", action="store_true", help="print one JSON object (a stable contract)")
    model_opts(r)

    i = sub.add_parser("info", help="load the model and print its name, dtype, parameters and KV bytes per token")
    i.add_argument("--json", action="store_true")
    model_opts(i)

    cp = sub.add_parser("compile", help="print the PML schema of a prompt program (FILE.py:FUNC); the file is "
                        "imported, so its top-level code runs")
    cp.add_argument("target", metavar="FILE.py[:FUNC]", help="FUNC may be left out when the file has one program "
                    "that no other program calls")
    cp.add_argument("--prompt", action="store_true", help="print the file's example call of FUNC (a PML prompt) "
                    "instead of the schema")
    for name, (help_text, add_arguments, _) in (extra or {}).items():
        add_arguments(sub.add_parser(name, help=help_text))
    return p


def add_run_options(r: argparse.ArgumentParser) -> None:
    """The RunConfig options (`run`, and the bench scripts), choices read from engine.config."""
    r.add_argument("--storage", default="cpu", choices=cfg.values("storage"), help="where module KV is stored")
    r.add_argument("--device", default=None, choices=cfg.values("device"),
                   help="where the model runs (default: cuda for --storage cuda, else cpu); --storage cpu "
                        "--device cuda copies module KV host-to-device per run, as in the paper's CPU-storage case")
    r.add_argument("--mode", default="prefixed", choices=cfg.values("mode"),
                   help="encoding mode: prefixed (modules see the system text before them) or isolated (the paper)")
    r.add_argument("--dtype", default=None, choices=cfg.COMPUTE_DTYPES,
                   help="compute dtype of the model (default: float32 on CPU, bfloat16 on CUDA; `info` says why)")
    r.add_argument("--storage-dtype", default=None, choices=cfg.values("storage_dtype"),
                   help="precision of stored module KV (default: the compute dtype; cast back to it when "
                        "assembled); int8 and "
                        "int4 quantize keys per channel and values per token (KIVI), about 26 %% and 15 %% of fp32 "
                        "with their scales")
    r.add_argument("--retention", type=float, default=1.0,
                   help="mean fraction of each module's KV kept per layer (PyramidInfer's schedule); 1 keeps all")
    r.add_argument("--compression", default="pyramid", choices=cfg.values("method"),
                   help="how tokens are chosen when --retention < 1: after the prompt's question is prefilled, by its "
                        "attention, fewer with depth (question; stored modules stay whole); or when modules are "
                        "stored, before any question: fewer with depth by attention (pyramid), the same fraction in "
                        "every layer (uniform), or the most recent only (recent)")
    r.add_argument("--budget-mb", type=float, default=None,
                   help="module memory budget in MiB (default: half the available memory); LRU eviction")
    r.add_argument("--no-persist", action="store_true",
                   help="do not save encoded modules to (or load them from) the cache folder")
    r.add_argument("--arms", default=",".join(cfg.DEFAULT_ARMS),
                   help=f"comma-separated arms to run, of {', '.join(cfg.ARMS)} (default: "
                        f"{','.join(cfg.DEFAULT_ARMS)}); prefix = exact reuse of the longest cached token prefix, as "
                        "vLLM/SGLang/llama.cpp do; blend = modular reuse with a share of cached tokens recomputed")
    r.add_argument("--no-warmup", action="store_true",
                   help="do not warm the prefix cache with the prompt importing every module in schema order "
                        "before a schema's first prefix run (it then holds only earlier runs' prompts)")
    defaults = cfg.RunConfig()
    r.add_argument("--repair", type=int, default=defaults.repair, metavar="K",
                   help=f"link-token repair: recompute the first K tokens of every module that did not see what "
                        f"precedes it, and after every argument (0 = off, at most {cfg.MAX_REPAIR}; "
                        f"default {defaults.repair})")
    r.add_argument("--blend", type=float, default=None, metavar="R",
                   help=f"blend arm: recompute this share of the cached tokens, e.g. 0.15 (CacheBlend's selective "
                        f"recompute; adds blend to the arms when R > 0; default {defaults.blend} when blend is in "
                        "--arms)")
    r.add_argument("--blend-rule", choices=cfg.BLEND_RULES, default=defaults.blend_rule,
                   help="how the blend arm picks the tokens it recomputes: largest KV deviation at layer 1 "
                        "(deviation, CacheBlend's rule), the question's attention, link tokens, a mix, or random "
                        f"(a control); default {defaults.blend_rule}")
    r.add_argument("--sink", type=int, default=defaults.sink, metavar="N",
                   help=f"isolated mode: encode each module after the prompt's first N tokens (the chat template's "
                        f"opening), whose KV is not stored with it (0 = off, at most {cfg.MAX_SINK}; "
                        f"default {defaults.sink})")


def config_from_args(args) -> "cfg.RunConfig":
    """The RunConfig the `run` options describe (validated here, once)."""
    return cfg.RunConfig(model=args.model, storage=args.storage, device=args.device, dtype=args.dtype, mode=args.mode,
                         storage_dtype=args.storage_dtype,
                         compression=cfg.Compression(args.retention, args.compression),
                         budget_bytes=cfg.budget_from_mib(args.budget_mb), persist=not args.no_persist,
                         arms=_arms(args), warmup=not args.no_warmup, repair=args.repair, sink=args.sink,
                         blend=cfg.RunConfig.blend if args.blend is None else args.blend, blend_rule=args.blend_rule)


def _arms(args) -> tuple[str, ...]:
    """--arms, plus blend when --blend R > 0 asks for it."""
    arms = cfg.parse_arms(args.arms)
    if args.blend and "blend" not in arms:
        arms += ("blend",)
    return arms


def main(argv: list[str] | None = None, extra: dict | None = None) -> int:
    """Run one command; ``extra`` adds commands (see :func:`build_parser`)."""
    args = build_parser(extra).parse_args(argv)
    handlers = {"check": cmd_check, "layout": cmd_layout, "run": cmd_run, "info": cmd_info, "compile": cmd_compile}
    handlers.update({name: handler for name, (_, _, handler) in (extra or {}).items()})
    try:
        return handlers[args.command](args)
    except PMLError as err:
        for prob in err.problems:
            print(prob, file=sys.stderr)
        return EXIT_INPUT
    except EngineError as err:
        print(f"pml-studio: error: {err}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        return 130


# ----------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------

def cmd_check(args) -> int:
    from .layout import layout as make_layout
    from .plan import plan_prompt
    from .pml import document_kind, parse_prompt, parse_schema

    problems: list[str] = []
    codec = None

    def get_codec():
        nonlocal codec
        if codec is None:
            from .models import load_tokenizer
            codec = load_tokenizer(args.model)[2]
        return codec

    schema_cache: dict[str, object] = {}

    def load_layout(path: str):
        if path not in schema_cache:
            schema_cache[path] = make_layout(parse_schema(_read(path), path), get_codec())
        return schema_cache[path]

    for f in args.files:
        try:
            text = _read(f)
            kind = document_kind(text)
            if kind == "prompt":
                prompt = parse_prompt(text, f)
                schema_path = args.schema or str(Path(f).with_name(f"{prompt.schema}.xml"))
                if not os.path.exists(schema_path):
                    raise PMLError(Problem(f, prompt.line, 1, f"no schema file found for schema '{prompt.schema}' "
                                           f"(looked for {schema_path})", "pass it with --schema SCHEMA.xml"))
                plan_prompt(load_layout(schema_path), prompt)
            else:
                load_layout(f) if kind == "schema" else parse_schema(text, f)
        except PMLError as err:
            problems += [str(p) for p in err.problems]
        except EngineError as err:
            msg = str(err)
            problems.append(msg if msg.startswith(f + ":") else f"{f}:1:1: error: {msg}")
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(f"ok: {len(args.files)} file(s) valid")
    return EXIT_INPUT if problems else EXIT_OK


def cmd_layout(args) -> int:
    from .layout import layout as make_layout
    from .models import load_tokenizer
    from .pml import parse_schema

    codec = load_tokenizer(args.model)[2]
    lay = make_layout(parse_schema(_read(args.schema), args.schema), codec)
    rows = lay.rows()
    if args.json:
        print(json.dumps({"schema": lay.name, "positions": lay.length, "anonymous_tokens": lay.anonymous_tokens(),
                          "modules": rows}, indent=2))
        return EXIT_OK
    print(f"schema {lay.name}: {lay.length} positions, {lay.anonymous_tokens()} anonymous tokens")
    print(_table(["module", "start", "end", "tokens", "params"],
                 [[r["module"] + ("" if r["cache"] else " (cache=false)"), r["start"], r["end"], r["tokens"],
                   r["params"]] for r in rows]))
    return EXIT_OK


def cmd_run(args) -> int:
    from .runner import Sampling
    from .session import Engine

    if args.max_new_tokens < 1:
        raise EngineError("--max-new-tokens must be at least 1")
    eng = Engine(config_from_args(args))
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed)
    result = eng.compare(_read(args.schema), _read(args.prompt), sampling, schema_source=args.schema,
                         prompt_source=args.prompt)
    data = result.to_json()
    if args.json:
        print(json.dumps(data))
        return EXIT_OK
    print(run_text(data))
    return EXIT_OK


def run_text(data: dict) -> str:
    """The plain-text report of one run (`run` without --json), from its JSON document."""
    arms = [a for a in data.get("arms", ["baseline", "cached"]) if data.get(a)]
    lines = [f"model {data['model']} · storage {data['storage']} · mode {data['mode']} · schema {data['schema']}",
             f"prompt {data['prompt_tokens']} tokens: {data['cached_tokens']} cached, {data['uncached_tokens']} "
             f"prefilled · store {data['store_bytes'] / 2**20:.1f} MiB ({data['storage_dtype']}, retention "
             f"{data['compression']['retention']:g}) · evictions {data['store_stats']['evictions']}"]
    stats = data["store_stats"]
    if stats.get("disk_corrupt"):
        lines.append(f"note: {stats['disk_corrupt']} module file(s) on disk were corrupted and were re-encoded")
    if stats.get("disk_write_errors"):
        lines.append(f"warning: {stats['disk_write_errors']} module file(s) could not be saved "
                     f"({stats.get('disk_error') or 'disk error'}); they are kept in memory only")

    def row(label, fn):
        return [label] + [fn(data[a]) for a in arms]

    lines.append(_table([""] + arms, [
        row("TTFT ms", lambda r: f"{r['ttft_ms']:.1f}" + (f" (copy {r['copy_ms']:.1f} included)" if r["copy_ms"] else "")),
        row("reused tokens", lambda r: r.get("reused_tokens", "-")),
        row("prefill tokens", lambda r: r["prefill_tokens"]),
        row("decode ms/token", lambda r: _fmt(r["decode_ms_per_token"])),
        row("peak RSS MiB", lambda r: f"{r['peak_rss_bytes'] / 2**20:.0f}"),
    ]))
    if data.get("speedup") is not None:
        lines.append(f"speedup {data['speedup']:.1f}x · same text: {data['same_text']} · first divergence: "
                     f"{data['first_divergence']} · first token agree: {data['first_token_agree']} · KL "
                     f"{data['first_token_kl']:.4f}")
    pre = data.get("prefix")
    if pre:
        stop = pre.get("stopped_at") or {}
        where = f"{stop.get('source')} {stop.get('owner')}".strip() if stop else "-"
        lines.append(f"prefix cache: reused {pre['reused_tokens']} of {data['prompt_tokens']} tokens"
                     + (" (a repeat of an earlier prompt)" if pre.get("repeat") else f", stopped at token "
                        f"{stop.get('token')} ({where})")
                     + f" · warmed with {pre['warmed_with']['summary']}")
        if data.get("prefix_speedup") is not None:
            lines.append(f"prefix speedup {data['prefix_speedup']:.1f}x · same text: {data['prefix_same_text']} · "
                         f"KL {data['prefix_first_token_kl']:.2g}")
    if data.get("blend"):
        b = data["blend"]
        lines.append(f"blend {b['blend_ratio']:g} ({b['rule']}): {b['recomputed_tokens']} cached tokens recomputed, "
                     f"selection {b['selection_ms']:.1f} ms (both in its TTFT)"
                     + (f" · speedup {data['blend_speedup']:.1f}x · same text: {data['blend_same_text']}"
                        if data.get("blend_speedup") is not None else ""))
    if data.get("cached") and data["cached"].get("recomputed_tokens"):
        lines.append(f"repair {data['repair']}: {data['cached']['recomputed_tokens']} cached tokens recomputed "
                     "(in the cached prefill and its TTFT)")
    lines += [f"--- {a} ---\n{data[a]['text']}" for a in arms]
    return "\n".join(lines)


def cmd_info(args) -> int:
    from .models import cuda_available
    from .session import Engine

    info = Engine(model=args.model).info()
    info["dtype_reason"] = cfg.dtype_reason(info["device"], info["dtype"])
    info["cuda_available"] = cuda_available()
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:20} {v}")
    return EXIT_OK


def cmd_compile(args) -> int:
    from .programs import ProgramError, load_program_file

    path, _, func = args.target.rpartition(":")
    if not path or not func.isidentifier():  # no ":FUNC" suffix
        path, func = args.target, ""
    programs = load_program_file(path)
    if not func:
        roots = programs.roots()
        if len(roots) != 1:
            raise ProgramError(Problem(path, 1, 1, f"the file has {len(roots)} top-level prompt programs",
                                       f"name one: {path}:FUNC with FUNC in {', '.join(roots) or 'none'}"))
        func = roots[0]
    prog = programs.programs.get(func)
    if prog is None:
        names = ", ".join(programs.programs) or "none (decorate functions with @prompt_program)"
        raise ProgramError(Problem(path, 1, 1, f"no prompt program named '{func}' in the file", f"programs: {names}"))
    if args.prompt:
        call = programs.example(func)
        if call is None:
            raise ProgramError(Problem(path, prog.line, 1, f"the file has no example call of {func}",
                                       f"add EXAMPLE = {func}.bind(...) at the end of the file"))
        sys.stdout.write(call.prompt_xml())
    else:
        sys.stdout.write(prog.schema_xml())
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise EngineError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise EngineError(f"{path}:1:1: error: the file is not UTF-8 text ({err.reason}); save it as UTF-8") from None
    except OSError as err:
        raise EngineError(f"{path}: cannot read: {err.strerror}") from None


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _table(header: list, rows: list[list]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
