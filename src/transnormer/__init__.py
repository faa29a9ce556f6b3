"""TransNormer, FLASH and linear-attention baselines."""
