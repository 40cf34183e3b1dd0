"""The CPU backend (numpy + numba)."""
