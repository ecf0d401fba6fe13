"""The local backend: learners as process groups on this machine (see backend.py)."""
