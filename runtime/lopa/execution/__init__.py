"""Executors: how a round's candidates are verified on devices (the decoder's Executor protocol).

protocol   the WindowModel protocol between executors and models
local      every candidate in one batched forward on one device (LocalExecutor)
sampling   per-position statistics (x_hat, P, Conf) from logits
openmp     one OpenMP thread pool per process: the loading thread hands its pool back
cpu_budget the CPU threads torch may run (a container's CPU quota included)
placement  which rank verifies which candidate when several ranks share a round
shard      one rank's share of a round, and the commits between ranks (ShardExecutor)
"""
