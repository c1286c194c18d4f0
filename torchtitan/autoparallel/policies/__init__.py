"""The settings a plan is made under: recompute, keep or gather again, FSDP units."""
