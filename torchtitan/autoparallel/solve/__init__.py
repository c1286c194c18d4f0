"""Stage 4: the 0/1 placement program, its engine and the user's constraints."""
