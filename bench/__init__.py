"""The benchmarks: one script per benchmark (``python bench/NAME.py``, each with a ``__main__`` guard) and the modules
they share (measurement and result records, workloads and needles, labelled arms, servers, peers, the pages). No
script imports another (tests/contract/test_architecture.py)."""
