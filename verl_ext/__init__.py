"""verl extensions of Search-R1, imported by verl in every Ray process through the `verl.plugins`
entry point (setup.py). The multi-GPU path (agent loop, reward function, registrations, GPU Hydra
entry) lands here in a later release; until then importing it registers nothing."""
