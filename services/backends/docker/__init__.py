"""The docker backend: learners as containers on a Docker engine (backend.py)."""
