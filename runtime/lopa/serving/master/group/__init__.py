"""The master's side of its worker group: one step stream per worker and the executor over them.

links        one step stream per worker, and the group state (attached or not)
distributed  the master's Executor: one step message per worker per round
"""
