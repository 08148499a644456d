"""The benchmarks behind `lopa bench` (their numbers go to runtime/BENCHMARKS.md).

tpf, evaluate, report  `lopa bench tpf`: LoPA vs D2F on the bundled model (tokens per forward)
ablation               `lopa bench ablation`: LoPA's winner choice against a random one and the anchor
orders                 `lopa bench orders`: TPF of random token-filling orders against LoPA's
single, figures        one request through a steered executor (the checks above); their PNGs
step                   `lopa bench step`: one decoding step against its weights' memory floor
concurrency            the concurrency sweep, over the local engine or a served group
serving                `lopa bench serving`: step time split and the sweep over real workers
transport              `lopa bench transport`: the step stream's round-trip floor
rows                   one JSON line per measured row, then a table
attacks, edges         `lopa bench edges`: hostile clients of a master's ports, at full size

The package imports nothing itself: a hostile client (attacks, a process of its own) starts
without torch.
"""
