"""The lifecycle manager: owns a job from admission to garbage collection (manager.py)."""
