"""Stage 2: candidate sharding strategies for every node of the traced graph."""
