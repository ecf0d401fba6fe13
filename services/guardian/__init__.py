"""The guardian: a job's delegate for deploy, monitoring and teardown (guardian.py)."""
