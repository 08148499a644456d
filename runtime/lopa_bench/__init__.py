"""The benchmarks behind `lopa bench` (their numbers go to runtime/BENCHMARKS.md), beside the
product: they import lopa, lopa never imports them (.importlinter).

cli                    `lopa bench`: the subcommands' flags (tpf's in cli itself), one module each

tpf, evaluate, report  `lopa bench tpf`: LoPA vs D2F on the bundled model (tokens per forward)
ablation               `lopa bench ablation`: LoPA's winner choice against a random one and the anchor
orders                 `lopa bench orders`: TPF of random token-filling orders against LoPA's
single, figures        one request through a steered executor (the checks above); their PNGs
commit_cost            `lopa bench commit`: the two-phase KV commit's cost per round
options                `lopa bench options`: branch score and branch count settings against the paper's
step                   `lopa bench step`: one decoding step against its weights' memory floor
products, weights      `lopa bench products`, `weights`: the step's matrix products and FP8 weights
profiling              torch.profiler around a piece of a benchmark
concurrency            the concurrency sweep, over the local engine or a served group
serving                `lopa bench serving`: step time split and the sweep over real workers
transport              `lopa bench transport`: the step stream's round-trip floor
clients                `lopa bench clients`: the community's clients (guidellm, inference-perf) against it
rows                   one JSON line per measured row, then a table
attacks, edges         `lopa bench edges`: hostile clients of a master's ports, at full size
samples                `lopa bench samples`: n samples in one request against n requests
shared_prompt          `lopa bench shared-prompt`: the first forward the samples of a prompt share
stream_cost            `lopa bench stream-cost`: the master's CPU per round along a long stream

The package imports nothing itself: a hostile client (attacks, a process of its own) starts
without torch.
"""
