"""The baseline arm's look."""

from . import View, register

register(View("baseline", "Baseline", "full prefill of every prompt token", "#f97316",
              "Baseline: full prefill, then decoding…"))
