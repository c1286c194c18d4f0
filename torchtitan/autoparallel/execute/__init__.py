"""Stage 5: the parallel module: lowering, FSDP-shaped buckets, the executor."""
