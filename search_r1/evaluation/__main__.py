"""`python -m search_r1.evaluation`: the evaluation CLI (search_r1/evaluation/cli.py says what it does)."""
import sys

from search_r1.evaluation.cli import main

if __name__ == "__main__":
    sys.exit(main())
