"""A catalog of small, ordinary LightningModules trained under DDP and under Elixir, compared result by result.

models.py   the cases: LightningModules, data, what each run does, and the tolerance of its comparison
harness.py  runs all cases under one strategy inside one spawned pair of gloo CPU ranks
compare.py  the comparisons against DDP
test_catalog.py  the pytest side: one test per (case, strategy)
"""
