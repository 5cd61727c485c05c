"""The generate loop every arm shares, one floor below the arms: a timed run (``timing``: the arm's fill, the
prefill, the first token), every forward over leased KV (``forward``), the decode step for runs alone or together and
the decoder (``decode``), the scheduler that decodes every request's runs together (``scheduler``), each model's KV
pool (``pools``), sampling, the events a run yields (``events``), peak memory, the token stream (``stream``) and the
run's types (``types``); and what arms build their runs from: attention specs (``attention``), partial forwards
(``layers``), the routed arm's joint recompute (``joint``), a remote server (``remote``). Nothing here imports
engine.arms."""
