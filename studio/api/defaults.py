"""The API's settings and their defaults, in one place that imports nothing (the CLI reads them while parsing,
before torch is imported)."""

# The arm that answers a request that names none (``--default-arm``). The issue asks for the fastest arm whose
# answers stay within one of the baseline's on the mixed workload and within 5 points of it on bench/fidelity.py's
# two-fact and aggregate sets, else the prefix cache, which is exact: until that measurement decides, the prefix cache.
DEFAULT_ARM = "prefix"
MAX_QUEUE = 16  # requests waiting for the engine before a 429 (the one running is not counted); --max-queue
MAX_TOKENS_CAP = 2048  # the most new tokens one request may ask for (as the studio's Compare); --max-new-tokens-cap
DEFAULT_PORT = 8000  # of `pml-studio api` (vLLM's and llama-cpp-python's)
