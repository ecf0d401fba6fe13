"""The contract between the platform (`services/`) and its learners (`learner/`).

Both sides import this package; it imports neither (tests/test_import_boundaries.py
checks). Everything that crosses the seam is written here once:

- `etcd_keys`    the etcd key layout;
- `env`          every environment variable a learner receives (`LearnerEnv`);
- `status`       learner statuses and process exit codes;
- `learner_spec` the spec a backend hands a learner controller (spec.json);
- `logs`         the log streams a learner ships to the training data service;
- `policy`       the checkpoint-interval formula the learner uses and the simulator models;
- `procs`        process helpers (free ports, liveness, process groups, job labels);
- `etcd`         the one etcd client wrapper, and how etcd is started;
- `registry`     the lazy name -> factory registry every plug-in point uses.

docs/architecture.md ("The seam between platform and learner") says who owns what.
"""
