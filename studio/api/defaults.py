"""The API's settings and their defaults, in one place that imports nothing (the CLI reads them while parsing,
before torch is imported)."""

# The arm that answers a request that names none (``--default-arm``), decided by bench/serve.py's rule and results
# (bench/results/serve-qwen2.5-coder-0.5b.json; docs/api.md "Which arm answers"): re-decide when the arms change.
DEFAULT_ARM = "routed"
MAX_QUEUE = 16  # requests waiting for the engine before a 429 (the one running is not counted); --max-queue
MAX_TOKENS_CAP = 2048  # the most new tokens one request may ask for (as the studio's Compare); --max-new-tokens-cap
DEFAULT_PORT = 8000  # of `pml-studio api` (vLLM's and llama-cpp-python's)
