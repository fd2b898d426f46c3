"""Evaluation: the implementation behind `python -m search_r1.eval` (runner) and its metrics/tables."""
