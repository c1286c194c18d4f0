"""Custom ops that model code calls (so the planner sees them as single nodes)."""
