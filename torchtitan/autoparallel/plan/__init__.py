"""Stage 4b: the plan, read off a solution, shown, cached and expanded to the whole model."""
