"""`pml-studio` command line: check, layout, run, info, compile (``serve`` is added by the studio).

Front ends that sit above the engine add their own commands through ``main(argv, extra)``:
the studio's entry point (``studio/cli.py``, the ``pml-studio`` console script) adds ``serve``,
and gives its words for the arms (:class:`engine.words.ArmWords`), so nothing here imports the studio.

Exit codes: 0 success, 2 a problem with the input or the environment (one line per problem,
``FILE:LINE:COL: error: MESSAGE``), never a traceback. ``run --json`` prints one JSON object
whose fields are a contract for other tools: new fields may be added, none renamed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from engine import config as cfg
from engine.cache.settings import canonical_mode
from engine.errors import EngineError, PMLError, Problem
from engine.cli_text import Progress, human, terminal_safe
from engine.describe import info_document
from engine.files import read_text
from engine.limits import NumberArg
from engine.model import PREFILL_KERNELS
from engine.words import ArmWords, speed_words, titled

EXIT_OK, EXIT_INPUT = 0, 2


class Parser(argparse.ArgumentParser):
    """argparse's parser, except that every negative number is a value, not an option: ``--temperature -inf``
    and ``--seed -1e3`` reach the option's check (and its message) instead of 'expected one argument'."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|infinity|nan)$", re.I)


def build_parser(extra: dict | None = None, arm_options: bool = True, words: ArmWords = ArmWords(),
                 allow_abbrev: bool = True) -> argparse.ArgumentParser:
    """The parser; ``extra`` maps command name -> (help, add_arguments(subparser), handler(args)). ``arm_options``
    adds the arms' options to ``run`` (importing torch), so :func:`main` asks for them for ``run`` alone."""
    p = Parser(prog="pml-studio", description="Modular prompt caching (PML) on your machine.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_opts(sp):
        sp.add_argument("--model", default=None, help="packaged model name, model folder or FILE.gguf (converted "
                        "once); never a hub id: nothing is downloaded (default: the packaged Qwen2.5-Coder-0.5B, "
                        "qwen2.5-coder-0.5b, or $PML_STUDIO_MODEL; SmolLM2-135M-Instruct is the small one)")
        return sp

    c = _command(sub, "check", "validate schema and prompt files; exit 2 with one line per problem")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--schema", help="schema file to check prompts against (default: SCHEMA-NAME.xml next to them)")
    model_opts(c)

    lay = _command(sub, "layout", "print each module's position range and token count")
    lay.add_argument("schema", metavar="SCHEMA")
    lay.add_argument("--json", action="store_true", help="print JSON instead of a table")
    model_opts(lay)

    model_opts(_run_parser(sub, arm_options, words, allow_abbrev))

    info = model_opts(_command(sub, "info", "load the model and print its name, dtype, parameters and KV bytes per "
                               "token"))
    info.add_argument("--json", action="store_true")
    cfg.add_kv_budget_option(info)
    add_prefill_option(info)

    cp = _command(sub, "compile", "print the PML schema of a prompt program (FILE.py:FUNC); the file is "
                        "imported, so its top-level code runs")
    cp.add_argument("target", metavar="FILE.py[:FUNC]", help="FUNC may be left out when the file has one program "
                    "that no other program calls")
    cp.add_argument("--prompt", action="store_true", help="print the file's example call of FUNC (a PML prompt) "
                    "instead of the schema")
    for name, (help_text, add_arguments, _) in (extra or {}).items():
        if name not in sub.choices:  # an engine command's name: its options, the front end's handler
            add_arguments(_command(sub, name, help_text))
    return p


def _command(sub, name: str, help_text: str, **kwargs) -> argparse.ArgumentParser:
    """A command's parser, its help line also the description its own --help prints."""
    about = help_text[:1].upper() + help_text[1:] + ("." if help_text and not help_text.endswith(".") else "")
    return sub.add_parser(name, help=help_text, description=about or None, **kwargs)


def _run_parser(sub, arm_options: bool, words: ArmWords, allow_abbrev: bool = True) -> argparse.ArgumentParser:
    r = _command(sub, "run", "encode the schema, then run baseline and cached on the prompt and compare",
                 allow_abbrev=allow_abbrev)
    r.add_argument("schema", metavar="SCHEMA")
    r.add_argument("prompt", metavar="PROMPT")
    add_run_options(r, arm_options, words)
    r.add_argument("--max-new-tokens", type=NumberArg("max_new_tokens"), default=32,
                   help=f"tokens generated by each arm, 1 to {cfg.MAX_NEW_TOKENS} (default 32)")
    r.add_argument("--temperature", type=NumberArg("temperature"), default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-p", type=NumberArg("top_p"), default=1.0,
                   help="when sampling, draw from the likeliest tokens holding this share of the probability, in "
                        "(0, 1] (default 1: all)")
    r.add_argument("--seed", type=NumberArg("seed"), default=0, help="seed of the sampling, 0 to 2**64 - 1")
    r.add_argument("--json", action="store_true", help="print one JSON object (a stable contract)")
    r.add_argument("--quiet", action="store_true", help="no progress lines on stderr (a terminal gets one per phase: "
                                                        "load, encode, each arm's prefill and first token, decode; "
                                                        "--json prints none either)")
    r.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                   help="replay the question's prefill and each decode step from a CUDA graph, for every arm "
                        "(auto, the default: on where the model computes on CUDA; never on the CPU, where `info` "
                        "says so)")
    return r


def add_prefill_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-kernel", default=None, choices=PREFILL_KERNELS,
                   help="what multiplies the packed weights in forwards of 16+ tokens (prefill, encoding, recompute): "
                        "auto (default, or $PML_STUDIO_PREFILL_KERNEL): bf16 GEMM where the CPU has bf16 matrix units "
                        "and it measures faster, else fp32 GEMM; gemm-bf16 / -fp32 / -int8 keep a copy of the weights "
                        "for it (0.5B: ~0.7 / 1.4 / 0.36 GB); blocks: the packed blocks, no copy (`info` says which)")


def add_run_options(r: argparse.ArgumentParser, arm_options: bool = True, words: ArmWords = ArmWords()) -> None:
    """The RunConfig options (`run`, and the bench scripts), choices read from engine.config; with
    ``arm_options`` the registered arms' own (:func:`add_arm_options`)."""
    r.add_argument("--storage", default="cpu", choices=cfg.values("storage"), help="where module KV is stored")
    r.add_argument("--device", default=None, choices=cfg.values("device"),
                   help="where the model runs (default: cuda for --storage cuda, else cpu); --storage cpu "
                        "--device cuda copies module KV host-to-device per run, as in the paper's CPU-storage case")
    r.add_argument("--mode", default="contextual", type=canonical_mode, choices=cfg.values("mode"),
                   help="encoding mode: contextual (modules see the system text before them; 'prefixed', its old "
                        "name, is accepted) or isolated (the paper's scheme)")
    r.add_argument("--weights", default=None, choices=cfg.values("weights"),
                   help="how the model's linear weights are kept: fp32 (as loaded), bf16, int8 / int4 weight-only "
                        "(activations stay in --dtype; int4 keeps the attention in int8), or gguf (a GGUF model's own "
                        "Q5_0 / Q4_K / Q8_0 / Q6_K blocks, exactly fp32's values, int8 elsewhere); every arm runs on "
                        "the same weights (default: gguf for the default model qwen2.5-coder-0.5b, fp32 for others)")
    add_prefill_option(r)
    r.add_argument("--decode", default="together", choices=cfg.values("decode"),
                   help="together (default): each arm's first token from its own timed run, then the arms decode as "
                        "one batch, the weights read once per step for all (each arm's decode_ms_per_token is then "
                        "the batch's step; decode_batch says how many shared it); apart: each arm decodes alone")
    r.add_argument("--dtype", default=None, choices=cfg.COMPUTE_DTYPES,
                   help="compute dtype of the model (default: float32 on CPU, bfloat16 on CUDA; `info` says why)")
    r.add_argument("--storage-dtype", default=None, choices=cfg.values("storage_dtype"),
                   help="precision of stored module KV (default: the compute dtype; cast back to it when assembled); "
                        "int8 and int4 quantize keys per channel and values per token (KIVI), about 26 %% and 15 %% "
                        "of fp32 with their scales")
    r.add_argument("--retention", type=NumberArg("retention"), default=1.0,
                   help="mean fraction of each module's KV kept per layer (PyramidInfer's schedule); 1 keeps all")
    r.add_argument("--compression", default="pyramid", choices=cfg.values("method"),
                   help="how tokens are chosen when --retention < 1: after the prompt's question is prefilled, by its "
                        "attention, fewer with depth (question; stored modules stay whole); or when modules are "
                        "stored, before any question: fewer with depth by attention (pyramid), the same fraction in "
                        "every layer (uniform), or the most recent only (recent)")
    _memory_options(r)
    r.add_argument("--no-persist", action="store_true",
                   help="do not save encoded modules to (or load them from) the cache folder")
    r.add_argument("--arms", default=None,
                   help="comma-separated arms to run (default: the registered default arms; `run --help` lists "
                        "them with their options)")
    r.add_argument("--no-warmup", action="store_true",
                   help="do not warm the prefix cache with the prompt importing every module in schema order "
                        "before a schema's first prefix run (it then holds only earlier runs' prompts)")
    sink = fields_default(cfg.RunConfig, "sink")
    if arm_options:
        add_arm_options(r, words)
    r.add_argument("--sink", type=NumberArg("sink"), default=sink, metavar="N",
                   help=f"isolated mode: encode each module after the prompt's first N tokens (the chat template's "
                        f"opening), whose KV is not stored with it (0 = off, at most {cfg.MAX_SINK}; "
                        f"default {sink})")


def _memory_options(r: argparse.ArgumentParser) -> None:
    r.add_argument("--budget-mb", type=NumberArg("budget_mib"), default=None,
                   help="module memory budget in MiB (default: half the available memory); LRU eviction")
    cfg.add_kv_budget_option(r)


def fields_default(cls, name: str):
    """A dataclass field's default, read without making an instance."""
    return cls.__dataclass_fields__[name].default


def add_arm_options(r, words: ArmWords = ArmWords()) -> None:
    """One option per setting of every registered arm (``--repair K``, ``--blend R``, ...), made from its
    :class:`engine.arms.registry.Setting`; not given, the arm's own default applies."""
    from engine.arms.registry import REGISTRY, default_arms, settings_specs

    group = r.add_argument_group("arms", "; ".join(_about(a, words) for a in REGISTRY)
                                 + f" (run by default: {','.join(default_arms())})")
    for spec, name, s in settings_specs():
        default = getattr(spec.settings(), name)
        kw = {"type": NumberArg(s.limit)} if s.limit is not None else {"choices": s.choices} if s.choices else {}
        extra = "; a value above 0 adds the arm to --arms" if s.enables else ""
        group.add_argument("--" + s.key.replace("_", "-"), dest=s.key, default=None, metavar=s.metavar,
                       help=f"{spec.name} arm: {s.help} ({s.how}; default {default}{extra})" if s.how else
                       f"{spec.name} arm: {s.help} (default {default}{extra})", **kw)
    group.add_argument("--ape", type=ApePair(), default=None, metavar="T,S",
                       help="APE at query time on the modular and routed arms: --ape-t T and --ape-s S at once "
                            "(the APE paper's default is 0.9,0.9)")


def _about(arm: str, words: ArmWords) -> str:
    said = [w for w in (words.title(arm), words.subtitle(arm)) if w and w != arm]
    return f"{arm}: {', '.join(said)}" if said else arm


class ApePair:
    """argparse ``type=`` of ``--ape T,S``: two numbers, each checked by its setting's Limit."""

    __name__ = "T,S"

    def __call__(self, text: str) -> tuple[float, float]:
        from engine.arms.modular import ModularSettings

        limits = {s.key: s.limit for _, s in ModularSettings.declared()}
        parts = text.split(",")
        if len(parts) != 2:
            raise argparse.ArgumentTypeError(f"APE takes two numbers, the temperature and the scale, as T,S "
                                             f"(e.g. 0.9,0.9); got '{text}'")
        try:
            return limits["ape_t"].check(parts[0].strip()), limits["ape_s"].check(parts[1].strip())
        except EngineError as err:
            raise argparse.ArgumentTypeError(str(err)) from None


def config_from_args(args) -> "cfg.RunConfig":
    """The RunConfig the `run` options describe (validated here, once)."""
    return cfg.RunConfig.make(model=args.model, storage=args.storage, device=args.device, dtype=args.dtype,
                              mode=args.mode, storage_dtype=args.storage_dtype, weights=args.weights,
                              decode=args.decode, compression=cfg.Compression(args.retention, args.compression),
                              budget_bytes=cfg.budget_from_mib(args.budget_mb), kv_budget_bytes=cfg.kv_budget_bytes(args),
                              persist=not args.no_persist,
                              arms=_arms(args), warmup=not args.no_warmup, sink=args.sink, **_arm_settings(args))


def _arm_settings(args) -> dict:
    """{setting key: value} of the arm options given on the command line."""
    from engine.arms.registry import settings_specs

    given = {s.key: getattr(args, s.key) for _, _, s in settings_specs() if getattr(args, s.key, None) is not None}
    if getattr(args, "ape", None) is not None:  # --ape T,S; --ape-t / --ape-s given as well win
        given = {"ape_t": args.ape[0], "ape_s": args.ape[1], **given}
    return given


def _arms(args) -> tuple[str, ...]:
    """--arms (default: the default arms), plus every arm whose enabling setting was given above 0 (--blend R)."""
    from engine.arms.registry import default_arms, settings_specs

    arms = cfg.parse_arms(args.arms) if args.arms else default_arms()
    for spec, _, s in settings_specs():
        if s.enables and (getattr(args, s.key, None) or 0) > 0 and spec.name not in arms:
            arms += (spec.name,)
    return arms


def main(argv: list[str] | None = None, extra: dict | None = None, words: ArmWords = ArmWords()) -> int:
    """Run one command; ``extra`` adds commands (see :func:`build_parser`), ``words`` names the arms."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    texts = None
    if command == "run" and not {"-h", "--help"} & set(argv):
        # run's options and files first, without the arms' (which import torch): a bad one is refused at once
        early, _ = build_parser(extra, arm_options=False, words=words, allow_abbrev=False).parse_known_args(argv)
        try:
            texts = _read(early.schema, "schema"), _read(early.prompt, "prompt")
        except EngineError as err:
            print(f"pml-studio: error: {err}", file=sys.stderr)
            return EXIT_INPUT
    args = build_parser(extra, arm_options=command == "run", words=words).parse_args(argv)
    if getattr(args, "prefill_kernel", None):
        from engine.model import prefill
        prefill.ask(args.prefill_kernel)
    handlers = {"check": cmd_check, "layout": cmd_layout, "run": lambda a: cmd_run(a, words, texts), "info": cmd_info,
                "compile": cmd_compile}
    handlers.update({name: handler for name, (_, _, handler) in (extra or {}).items()})
    try:
        return handlers[args.command](args)
    except PMLError as err:
        for line in err.lines():
            print(line, file=sys.stderr)
        return EXIT_INPUT
    except EngineError as err:
        print(f"pml-studio: error: {terminal_safe(str(err))}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        return 130


# ----------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------

def cmd_check(args) -> int:
    from engine.schema.layout import layout as make_layout
    from engine.schema.plan import plan_prompt
    from engine.schema.pml import document_kind, parse_prompt, parse_schema

    problems: list[str] = []
    codec = None

    def get_codec():
        nonlocal codec
        if codec is None:
            from engine.model.load import load_tokenizer
            codec = load_tokenizer(args.model)[2]
        return codec

    schema_cache: dict[str, object] = {}

    def load_layout(path: str, text: str | None = None):
        if path not in schema_cache:  # `text`: already read (a pipe gives its text once)
            schema_cache[path] = make_layout(parse_schema(_read(path) if text is None else text, path), get_codec())
        return schema_cache[path]

    named = _schemas_named(args.files)
    for f in args.files:
        try:
            text = _read(f)
            kind = document_kind(text)
            if kind == "prompt":
                prompt = parse_prompt(text, f)
                schema_path = (args.schema or named.get(prompt.schema)
                               or str(Path(f).with_name(f"{prompt.schema}.xml")))
                if not os.path.exists(schema_path):
                    raise PMLError(Problem(f, prompt.line, 1, f"no schema file found for schema '{prompt.schema}' "
                                           f"(looked for {schema_path})",
                                           "name the schema file on the same command line, or pass --schema SCHEMA.xml"))
                plan_prompt(load_layout(schema_path), prompt)
            else:
                load_layout(f, text) if kind == "schema" else parse_schema(text, f)
        except PMLError as err:
            problems += err.lines()
        except EngineError as err:
            msg = str(err)
            problems.append(msg if msg.startswith(f + ":") else f"{f}:1:1: error: {msg}")
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(f"ok: {len(args.files)} file(s) valid")
    return EXIT_INPUT if problems else EXIT_OK


def _schemas_named(files: list[str]) -> dict[str, str]:
    """{schema name: file} of the schemas on the command line that parse (a prompt is checked against its own)."""
    from engine.schema.pml import document_kind, parse_schema

    named: dict[str, str] = {}
    for f in files:
        try:
            text = _read(f)
            if document_kind(text) == "schema":
                named.setdefault(parse_schema(text, f).name, f)
        except EngineError:
            continue  # reported when its turn comes
    return named


def cmd_layout(args) -> int:
    from engine.model.load import load_tokenizer
    from engine.schema.layout import layout as make_layout
    from engine.schema.pml import parse_schema

    text = _read(args.schema, "schema")  # before the model: a file that cannot be read stops at once
    codec = load_tokenizer(args.model)[2]
    lay = make_layout(parse_schema(text, args.schema), codec)
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


def cmd_run(args, words: ArmWords = ArmWords(), texts: tuple[str, str] | None = None) -> int:
    from engine.arms.registry import REGISTRY, Sampling
    from engine.session import Engine, reads_prefix_cache

    schema, prompt = texts or (_read(args.schema, "schema"), _read(args.prompt, "prompt"))  # before the model loads
    eng = Engine(config := config_from_args(args))
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed)
    order = tuple(str(a) for a in REGISTRY if str(a) in config.arms)  # as compare() runs them
    told = Progress(order, sampling.max_new_tokens, words, quiet=args.quiet or args.json,
                    warms=config.warmup and reads_prefix_cache(config))
    if not eng.loaded:
        told.loading(config.model or "the default model")
    took = _timed(lambda: eng.lm)
    told.loaded(getattr(eng.lm, "name", None) or config.model or "the default model", took)
    if args.cuda_graphs != "auto":
        from engine.model import graphs
        graphs.set_mode(eng.lm.model, args.cuda_graphs)
    started = time.perf_counter()
    result = told.follow(eng.events(schema, prompt, sampling, schema_source=args.schema, prompt_source=args.prompt))
    told.done(time.perf_counter() - started)
    data = titled(result.to_json(), words)
    if data["store_stats"].get("disk_note"):  # a stored module that could not be used was encoded again
        print(f"pml-studio: note: {terminal_safe(data['store_stats']['disk_note'])}", file=sys.stderr)
    if args.json:
        print(strict_json(data))
        return EXIT_OK
    print(terminal_safe(run_text(data, words)))  # the texts are a model's and a server's words
    return EXIT_OK


def run_text(data: dict, words: ArmWords = ArmWords()) -> str:
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
        lines.append(f"{_speed(data['speedup'])} · same text: {data['same_text']} · first divergence: "
                     f"{data['first_divergence']} · first token agree: {data['first_token_agree']} · KL "
                     f"{data['first_token_kl']:.4f}")
    lines += _arm_lines(data, arms, words)
    lines += [f"--- {a} ---\n{data[a]['text']}" for a in arms]
    return "\n".join(lines)


def _arm_lines(data: dict, arms: list[str], words: ArmWords) -> list[str]:
    """One line per arm beside the modular one: its details (the spec's detail type), agreement and what it
    recomputed."""
    from engine.arms.registry import REGISTRY

    lines = []
    for arm in arms:
        spec, run, by = REGISTRY.get(arm), data.get(arm) or {}, (data.get("by_arm") or {}).get(arm) or {}
        if spec is None or arm == "baseline":
            continue
        detail = spec.detail_from_json(run)
        facts = list(words.facts(arm, detail)) if detail is not None else []
        if run.get("recomputed_tokens"):
            facts.append(f"{run['recomputed_tokens']} cached tokens recomputed (in its prefill and TTFT)")
        agree = by.get("agreement") or {}
        if arm != "cached" and by.get("speedup") is not None:
            facts.append(f"{_speed(by['speedup'])} · same text: {agree.get('same_text')} · "
                         f"KL {agree.get('first_token_kl') or 0:.2g}")
        if facts:
            lines.append(f"{words.title(arm)}: " + " · ".join(facts))
    return lines


def _timed(work) -> float:
    """Seconds ``work()`` took."""
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _speed(speedup: float) -> str:
    """'speedup 2.0x (2.0× faster first token)'; a ratio under 1 reads as slower."""
    return f"speedup {speedup:.2f}x ({speed_words(speedup)} first token)"


def cmd_info(args, words=None) -> int:
    from engine.devices import cuda_available
    from engine.model.graphs import gpu_paths
    from engine.session import Engine

    eng = Engine(model=args.model, kv_budget_bytes=cfg.kv_budget_bytes(args))
    told = Progress((), 0, ArmWords(), quiet=args.json)
    told.say(f"loading {args.model or 'the default model'} to count its parameters and KV bytes: the weights' load "
             "is what takes the time (seconds once its packed copy is saved, a minute at its first conversion)")
    told.loaded(args.model or "the default model", _timed(lambda: eng.lm))
    info = info_document(eng.info())
    info["cuda_available"] = cuda_available()
    info.update(words(info) if words else {})
    info.update(gpu_paths(info["device"]))  # pinned_storage, layerwise_copies, cuda_graphs
    if args.json:
        print(strict_json(info))
    else:
        for k, v in info.items():
            print(f"{k:20} {human(v)}")
    return EXIT_OK


def cmd_compile(args) -> int:
    from engine.programs import ProgramError, load_program_file

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


# -- The words of `info` (the studio's Model tab says the same) --

# -- Helpers --

def _read(path: str, what: str = "schema or prompt") -> str:
    """The text of a schema or prompt file, read within the document limit (engine.files)."""
    return read_text(path, what)


def strict_json(data) -> str:
    """``data`` as JSON strict parsers read: NaN and infinities are written null."""
    return json.dumps(_finite(data), allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


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
