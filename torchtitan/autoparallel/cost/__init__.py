"""Stage 3: what a choice costs: compute and collective time, memory per rank."""
