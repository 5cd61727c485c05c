"""`pml-studio encode SCHEMA`: a schema's modules encoded into the module store on disk ahead of traffic, so that a
later run, studio or API start loads them instead of encoding them at a request's first sight. A command added to
engine/cli.py's parser the way a front end adds its own (``extra``: studio/cli.py), so engine/cli.py stays its size."""

from __future__ import annotations

import argparse
import sys

from engine import config as cfg
from engine.errors import EngineError

ABOUT = ("encode a schema's modules into the module store on disk, so that a later run, studio or API start finds "
         "them stored (warm a schema ahead of traffic)")


def add_encode_arguments(enc: argparse.ArgumentParser) -> None:
    from engine.cli import add_run_options

    enc.add_argument("schema", metavar="SCHEMA")
    add_run_options(enc, arm_options=False)  # the settings that name the stored files, as `run` takes them
    enc.add_argument("--json", action="store_true", help="print one JSON object (a stable contract)")
    enc.add_argument("--model", default=None, help="packaged model name, model folder or FILE.gguf, as `run` takes it "
                     "(the stored files are the model's own)")


def cmd_encode(args) -> int:
    from engine.cli import EXIT_INPUT, EXIT_OK, _read, config_from_args, strict_json
    from engine.words import ArmWords
    from engine.cli_text import Progress
    from engine.session import Engine, encode_summary

    schema = _read(args.schema, "schema")  # before the model loads
    if args.no_persist:
        raise EngineError("encode saves modules on disk for a later start; --no-persist would keep them nowhere "
                          "(leave it out)")
    eng = Engine(config_from_args(args))
    lay = eng.layout(schema, args.schema)
    told = Progress((), 0, ArmWords())
    res = told.follow(eng.encoding(lay, eng.config))
    summary = {k: v for k, v in encode_summary(res.encoded).items() if k != "detail"}
    store = eng.store(eng.config.storage)
    data = {"schema": lay.schema.name, "model": eng.lm.name, "mode": eng.config.mode,
            "storage_dtype": cfg.short_dtype(res.encoded.dtype), "store_bytes": res.store_bytes,
            "module_dir": str(eng.config.modules_path), "disk_write_errors": store.stats().get("disk_write_errors", 0),
            "encode": summary, "units": [{"unit": u.name, "kind": u.kind, "tokens": u.tokens, "source": u.source,
                                          "ms": round(u.ms, 3)} for u in res.encoded.units]}
    if args.json:
        print(strict_json(data))
        return EXIT_INPUT if data["disk_write_errors"] else EXIT_OK
    print(f"{data['schema']}: {summary['units']} units · {summary['encoded']} encoded, {summary['disk']} already on "
          f"disk, {summary['memory']} in memory · {summary['ms'] / 1000:.2f} s · {res.store_bytes / 2**20:.1f} MiB "
          f"({data['storage_dtype']}, {data['mode']}) · saved under {data['module_dir']}")
    if data["disk_write_errors"]:
        print(f"pml-studio: warning: {data['disk_write_errors']} module file(s) could not be saved", file=sys.stderr)
        return EXIT_INPUT
    return EXIT_OK


COMMAND = {"encode": (ABOUT, add_encode_arguments, cmd_encode)}  # engine.cli.main's ``extra``


if __name__ == "__main__":  # python -m engine.cli_encode encode SCHEMA: the engine's CLI with this command
    from engine.cli import main

    sys.exit(main(sys.argv[1:], COMMAND))
