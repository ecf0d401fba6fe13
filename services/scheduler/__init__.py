"""The BSA gang scheduler: cluster model, placement, queues, quotas, service, simulator.

Modules, one concern each:

- ``api``        requests, results, job states, abstract interfaces, typed errors
- ``cluster``    nodes and their free resources; ``load_cluster_config(path)``
- ``placement``  policies by name: ``pack`` (BSA, default), ``spread``, ``first-fit``, ``exact``
- ``elasticity`` scaling policies of elastic jobs by name: ``none`` (default), ``elastic-tiresias``
- ``queue``      FCFS with largest-gang-first among jobs submitted together
- ``quota``      per-user, per-GPU-type quotas and limits; borrowing and preemption
- ``explain``    why a job waits, in words
- ``scheduler``  ``GangScheduler``: the library the service wraps and the simulator drives
- ``persist``    where records are kept (memory twin, MongoDB through services.store)
- ``requests``   job record → scheduler request (the one place), and its proto form
- ``servicer``   the gRPC servicer for ``rhizome.v1.Scheduler``
- ``sim``        the cluster simulator (``python -m services.scheduler.sim --help``), and
                 Tiresias vs Elastic-Tiresias (``sim/elastic.py``)
"""

from services.scheduler.api import (
    AdmitResult,
    ClusterConfigError,
    InvalidJobRequest,
    JobRequest,
    JobTooLarge,
    Placement,
    QuotaConfigError,
    SchedState,
    SchedulerError,
    ScheduleResult,
    UnknownGpuType,
    UnknownJob,
    UnknownPolicy,
)
from services.scheduler.cluster import Cluster, Node, load_cluster_config
from services.scheduler.scheduler import GangScheduler

__all__ = [
    "AdmitResult",
    "Cluster",
    "ClusterConfigError",
    "GangScheduler",
    "InvalidJobRequest",
    "JobRequest",
    "JobTooLarge",
    "Node",
    "Placement",
    "QuotaConfigError",
    "SchedState",
    "ScheduleResult",
    "SchedulerError",
    "UnknownGpuType",
    "UnknownJob",
    "UnknownPolicy",
    "load_cluster_config",
]
