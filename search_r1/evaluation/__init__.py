"""Evaluation: `python -m search_r1.evaluation` (cli.py, the rollouts in runner.py) and the analyses of its
output directories (compare, hop_failures, answer_logprob, plan_probe)."""
