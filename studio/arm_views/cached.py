"""The modular-cache arm's look."""

from . import View, register

register(View("cached", "Modular cache", "module KV reused, the rest prefilled", "#4f46e5",
              "Modular cache: reusing module KV, prefilling the rest…",
              token_class=("recomputed", "recomputed at run time (repair)")))
