"""`lopa bench clients`: the community's benchmark clients (guidellm, inference-perf) against `lopa serve`.

Each client runs from its own venv (Python >= 3.12, built from PyPI by tools/bench-clients/setup.sh)
with its default request options: only the target, the model, the tokenizer directory, the data and
the load are chosen. The runner starts `lopa serve`, sends each client's default request bodies once
(`probe`: the server's answer to each), runs the clients one after the other, reads their JSON reports
and compares them with lopa's own numbers over the same window: the requests and tokens it counted
and its TTFT / TPOT histograms (`lopa_time_to_first_token_seconds`,
`lopa_time_per_output_token_seconds` on the metrics port), plus the vLLM-named series a client or a
gateway reads from `/metrics` on the API port.

Modules: toolchain (the client venvs), served (`lopa serve` and its metrics), probe (default bodies),
vllm_metrics (the API port's /metrics), results (what a client reported), guidellm / inference_perf
(config and report of each), compare (checks and the table), runner (one run end to end).
"""
