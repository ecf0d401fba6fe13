"""The kubernetes backend: learners as pods, bound by our gang scheduler (docs/kubernetes.md)."""
