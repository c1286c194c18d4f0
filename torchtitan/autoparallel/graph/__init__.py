"""Leaves every stage shares: traced nodes, placements, the names of edges."""
