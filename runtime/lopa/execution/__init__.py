"""Executors: how a round's candidates are verified on devices (the contract is
lopa.decoding.executor; the window forward they drive is lopa.model.protocol).

local      every candidate in one batched forward on one device (LocalExecutor)
sampling   per-position statistics (x_hat, P, Conf) from logits
faults     which errors mean the device itself failed
placement  which rank verifies which candidate when several ranks share a round
shard      one rank's share of a round, and the commits between ranks (ShardExecutor)
twins      requests whose first forward is one forward (the n samples of a prompt)
vocab_pass when a round's statistics come from the model's pass over the vocabulary
"""
