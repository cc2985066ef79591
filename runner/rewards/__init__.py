"""Reward helpers shared by envs: math answer grading, a subprocess sandbox for untrusted code, a trained reward
model as a pairwise judge (`judge.py`, also the reward model's own accuracy)."""
