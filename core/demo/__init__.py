"""The embedded default: a tiny model built locally and real vLLM servers around it."""
