"""Custom ops the planner traces as one node, and the DTensor rules it registers."""
