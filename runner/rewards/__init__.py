"""Reward helpers shared by envs: math answer grading and a subprocess sandbox for untrusted code."""
