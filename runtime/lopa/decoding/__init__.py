"""D2F and LoPA decoding as pure Python (no torch): docs/decoding.md sections 2-4.

blocks      one branch's block table
rules       the decision rules: growth, fills, scores, the winner, spawns
executor    the executor contract: Executor (a round of one or many requests), its types
generation  one request's decoding, one round at a time
decoder     one request alone over any Executor
"""
