"""Studio handlers called directly (no server), on the tiny random-weight Llama — Encode tab and the run settings: module bytes, precision, retention, budget, persistence."""

from __future__ import annotations

import ast
import csv

import gradio as gr
import pytest

from engine.runlog import RunLog
from studio import builder as b
from studio import files, views
from studio.settings import Panel
from studio.state import Studio
from studio.tabs import compare as cmp
from studio.tabs import encode as enc
from studio.tabs import history as hist
from studio.tabs import model as mdl
from studio.tabs import prompt as prm
from studio.tabs import schema as sch
from tests.conftest import ROOT

from tests.studio_fixtures import CPU, TRAVEL_PROMPT, doc, settings, studio, travel  # noqa: F401 (fixtures)


def test_run_config_from_widget_values(studio):
    base = studio.engine.config
    cfg = studio.run_config(settings(storage_dtype="float16", retention=0.5, method="uniform", budget_mib=64))
    assert (cfg.storage_dtype, cfg.compression.retention, cfg.compression.method) == ("float16", 0.5, "uniform")
    assert cfg.budget_bytes == 64 * 2**20 and studio.engine.store("cpu").budget_bytes == 64 * 2**20
    assert cfg.same_model(base) and cfg.persist == base.persist  # the model and the rest are the engine's
    assert studio.run_config({}) == base  # nothing given: the engine's config
    assert studio.run_config({"mode": "isolated", "budget_mib": ""}).mode == "isolated"
    for bad, match in ((dict(retention=0), "retention"), (dict(method="zip"), "method"),
                       (dict(storage_dtype="int2"), "storage dtype"), (dict(mode="both"), "encoding mode"),
                       (dict(budget_mib="lots"), "budget"), (dict(budget_mib=-5), "budget")):
        with pytest.raises(gr.Error, match=match):
            studio.run_config(settings(**bad))


@pytest.mark.parametrize("field", ["retention", "budget_mib", "repair", "sink", "blend"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 2**70, -2**70, "1e400", "abc", "0x10"])
def test_encode_settings_refuse_non_finite_and_huge_values_by_name(studio, travel, field, value):
    from engine.config import limit_of

    with pytest.raises(gr.Error) as err:
        enc.encode(studio, travel[0], settings(**{field: value}))
    message = err.value.message
    assert message.startswith(f"{limit_of(field).name} must be ") and "e.g." in message and "Traceback" not in message


def test_settings_widgets_offer_the_engines_choices(tmp_path, tiny_engine):
    from studio.settings import radio_choices
    from studio.app import build_app

    demo = build_app(tiny_engine, RunLog(tmp_path / "r.db"))
    by_id = {c.elem_id: c for c in demo.blocks.values() if getattr(c, "elem_id", None)}
    assert [tuple(c) for c in by_id["storage-dtype"].choices] == [tuple(c) for c in radio_choices("storage_dtype")]
    assert [tuple(c) for c in by_id["compression-method"].choices] == [tuple(c) for c in radio_choices("method")]
    radios = [c for c in demo.blocks.values() if isinstance(c, gr.Radio)]
    assert [tuple(c) for c in radio_choices("mode")] in [[tuple(x) for x in r.choices] for r in radios]


def test_encode_reports_bytes_per_module(studio, travel):
    schema, _, _ = travel
    calls = []
    view = enc.encode(studio, schema, settings(), lambda d, t, label: calls.append((d, t)))
    lay = studio.layout(schema)
    tokens = lay.entry_tokens()
    per_token = studio.engine.kv_bytes_per_token()  # from the model config alone
    assert {r[0]: r[1] for r in view.entries} == {k: v for k, v in tokens.items() if k in view.nbytes}
    assert "(anonymous)" in view.nbytes and "trip-plan/overseas/kyoto" in view.nbytes
    for name, nbytes in view.nbytes.items():
        assert nbytes == tokens[name] * per_token, name  # fp32, nothing dropped
    assert calls and calls[-1][0] == calls[-1][1]
    assert {r[3] for r in view.units} == {"fresh encode"}
    assert view.counts == {"memory": 0, "disk": 0, "encoded": len(view.units)}
    assert "before" in view.memory and "evictions" in view.memory and "pinned" in view.memory
    again = enc.encode(studio, schema, settings())
    assert "nothing was recomputed" in again.summary
    assert {r[3] for r in again.units} == {"memory"} and again.counts["memory"] == len(view.units)


def test_encode_on_gpu_without_cuda_is_a_gr_error(studio, travel):
    from engine.session import gpu_status

    if gpu_status()[0]:
        pytest.skip("a CUDA device is present")
    with pytest.raises(gr.Error, match="CUDA"):
        enc.encode(studio, travel[0], settings(storage="cuda"))


def _module_bytes(view) -> int:
    return sum(n for name, n in view.nbytes.items() if name != "(anonymous)")


def test_float16_storage_halves_module_bytes_and_reports_sources(studio, travel):
    schema, _, _ = travel
    full = enc.encode(studio, schema, settings(storage_dtype="float32"))
    half = enc.encode(studio, schema, settings(storage_dtype="float16"))
    assert _module_bytes(half) * 2 == _module_bytes(full) > 0
    assert half.nbytes["(anonymous)"] == full.nbytes["(anonymous)"]  # system text stays in the compute dtype
    sources = {r[0]: r[3] for r in half.units}
    assert sources["(anonymous)"] == "memory"  # shared with the fp32 encode
    assert {s for name, s in sources.items() if name != "(anonymous)"} == {"fresh encode"}
    assert half.counts["memory"] == 1 and half.counts["encoded"] == len(half.units) - 1
    assert "fp16" in half.summary


def test_retention_half_stores_at_most_52_percent(studio, travel):
    schema, _, _ = travel
    full = enc.encode(studio, schema, settings())
    for method in ("pyramid", "uniform", "recent"):
        comp = enc.encode(studio, schema, settings(retention=0.5, method=method))
        assert _module_bytes(comp) <= 0.52 * _module_bytes(full), method
        assert "50 %" in comp.summary
    with pytest.raises(gr.Error, match="retention"):
        enc.encode(studio, schema, settings(retention=0))
    with pytest.raises(gr.Error, match="method"):
        enc.encode(studio, schema, settings(retention=0.5, method="zip"))
    with pytest.raises(gr.Error, match="storage dtype"):
        enc.encode(studio, schema, settings(storage_dtype="int2"))  # int8 and int4 are valid since issue 10


def test_budget_too_small_is_a_clean_error_and_leaves_no_row(studio, travel):
    schema, prompt, _ = travel
    with pytest.raises(gr.Error, match="budget") as err:
        enc.encode(studio, schema, settings(budget_mib=0.001))
    assert "Traceback" not in err.value.message and "MiB" in err.value.message
    with pytest.raises(gr.Error, match="budget"):
        list(cmp.compare_stream(studio, schema, prompt, 2, settings=settings(budget_mib=0.001)))
    for bad in (0, -5, "lots"):
        with pytest.raises(gr.Error, match="budget"):
            enc.encode(studio, schema, settings(budget_mib=bad))
    assert studio.runlog.count() == 0
    view = enc.encode(studio, schema, settings(budget_mib=64))  # raising it makes the same run work
    assert studio.engine.store("cpu").budget_bytes == 64 * 2**20 and "64.0 MiB" in view.memory
    assert enc.memory_defaults(studio)["budget_mib"] == 64.0


def test_budget_evicts_and_the_readouts_show_it(studio, travel):
    schema, _, _ = travel
    first = enc.encode(studio, schema, settings())
    total = sum(first.nbytes.values())
    view = enc.encode(studio, schema, settings(storage_dtype="float16", budget_mib=total * 0.9 / 2**20))
    stats = studio.engine.store("cpu").stats()
    assert stats["evictions"] > 0 and stats["pinned"] >= 1
    assert '<tr class="changed"><th>evictions</th>' in view.memory


def test_persistence_is_shown(studio, tiny_lm, tmp_path):
    from engine.session import Engine

    assert "persistence off" in enc.persistence_html(studio)
    on = Studio(Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mods"), studio.runlog)
    assert "persistence on" in enc.persistence_html(on) and str(tmp_path / "mods") in enc.persistence_html(on)


def test_restart_with_persistence_encodes_nothing(tiny_lm, travel, tmp_path):
    from engine.session import Engine

    schema, _, _ = travel
    first = Studio(Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mods"), RunLog(tmp_path / "a.db"))
    view = enc.encode(first, schema, settings(storage_dtype="float16"))
    assert view.counts["encoded"] == len(view.units)
    restarted = Studio(Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mods"),
                       RunLog(tmp_path / "a.db"))
    again = enc.encode(restarted, schema, settings(storage_dtype="float16"))
    assert again.counts == {"memory": 0, "disk": len(view.units), "encoded": 0}
    assert {r[3] for r in again.units} == {"disk"} and "0 unit(s) encoded afresh" in again.summary
    assert '<tr class="changed"><th>disk loads</th>' in again.memory


def _tab_of(demo) -> dict:
    """elem_id -> (the tab's id, the titles of the accordions around it), by walking the rendered Blocks tree."""
    found: dict = {}

    def walk(block, tab, folds):
        if isinstance(block, gr.Tab):
            tab = block.id
        if isinstance(block, gr.Accordion):
            folds = folds + ((block.label, block.open),)
        if getattr(block, "elem_id", None):
            found[block.elem_id] = (tab, folds)
        for child in getattr(block, "children", []):
            walk(child, tab, folds)

    walk(demo, None, ())
    return found


def test_arms_are_chosen_in_compare_with_their_settings_folded_beside_them(tmp_path, tiny_engine):
    """Issue 48 item 5: the arm toggles sit in Compare, each arm's settings in a closed accordion of its own;
    Encode keeps storage, mode and precision in view, the rest folded, and Module memory is a titled section."""
    from engine.arms.registry import settings_specs
    from studio.app import build_app
    from studio.arm_views import view_of

    demo = build_app(tiny_engine, RunLog(tmp_path / "r.db"))
    where = _tab_of(demo)
    assert where["arms"] == ("compare", ())
    for spec, _, s in settings_specs():
        tab, folds = where[s.key.replace("_", "-")]
        assert tab == "compare" and folds == ((f"{view_of(spec.name).title}: settings", False),), s.key
    for elem in ("storage-dtype", "encode-btn"):
        assert where[elem] == ("encode", ()), elem
    for elem in ("retention", "compression-method", "sink"):
        assert where[elem][0] == "encode" and where[elem][1][0][1] is False, elem  # folded away
    assert where["budget-mib"][0] == "encode" and where["budget-mib"][1][0][0].startswith("Module memory")
    assert where["memory-view"][1] == where["budget-mib"][1]
