"""The generate loop every arm shares, one floor below the arms: a timed run (``timing``: the arm's fill, the
prefill, the first token), the one decode loop and its step for a run alone or runs together (``decode``),
sampling, the events a run yields (``events``), the KV workspace, peak memory, the token stream (``stream``) and
the run's types (``types``); and what arms build their runs from: attention specs (``attention``), partial
forwards (``layers``), the routed arm's joint recompute (``joint``). Nothing here imports engine.arms."""
