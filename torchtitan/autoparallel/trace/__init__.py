"""Stage 1: a model on meta traced into one joint forward+backward graph."""
