"""torchtitan-style LLM trainer."""
