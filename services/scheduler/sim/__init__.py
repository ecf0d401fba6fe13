"""The cluster simulator: replays job traces through the real GangScheduler.

``python -m services.scheduler.sim --help``; ``engine.simulate`` is the library entry.
"""
