"""A jobs repository that records which of its methods the LCM calls (the LCM tests)."""

from __future__ import annotations

from typing import Any

from services.store.jobs import JobsRepository


class RecordingRepo:
    """The LCM's jobs repository, recording which of its methods a round calls."""

    def __init__(self, repo: JobsRepository) -> None:
        self._repo = repo
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._repo, name)
        if callable(attr):
            self.calls.append(name)
        return attr
