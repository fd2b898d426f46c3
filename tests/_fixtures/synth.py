"""Session fixture `synth_world` (filled in with the synthetic data generator)."""
