"""The model layer: loading (load.py, gguf.py, sanity.py), positions and attention (positions.py, attend.py) and
weight precision (weights.py). Names here import no torch."""

# weight precisions (engine/model/weights.py); gguf: each layer as the model's GGUF file holds it where it can
WEIGHTS = ("fp32", "bf16", "int8", "int4", "gguf")
