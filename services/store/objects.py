"""Object storage moved to `services/objectstore` (a shared volume or an S3-compatible
store, chosen by platform configuration); `LocalObjectStore` is the volume kind."""

from __future__ import annotations

from services.objectstore.volume import VolumeStore as LocalObjectStore

__all__ = ["LocalObjectStore"]
