"""Test-only stand-ins shared by the suites: a rule-driven WindowModel (rule_model) and a mixed
load of the bundled model's held-out prompts (mixed)."""
