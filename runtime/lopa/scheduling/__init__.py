"""Continuous batching: many requests advance one LoPA round per batched forward.

request      a request as the scheduler holds it, and what it becomes
limits       what one server or engine accepts and holds at once (the config's limits section)
budget       how many lookahead branches each running request gets in a round
calibration  the budget an accelerator measures at start
scheduler    the thread that runs every round
alone        one request decoded alone through the same rounds, on the caller's thread
warmup       the CUDA graphs a server captures at start, before it reports SERVING
"""
