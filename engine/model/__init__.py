"""The model layer: loading (load.py, gguf.py, sanity.py), positions and attention (positions.py, attend.py) and
weight precision (weights.py). Names here import no torch."""

WEIGHTS = ("fp32", "bf16", "int8", "int4")  # weight precisions (engine/model/weights.py)
