"""Job manifests: the published schema, the parser the API runs at submit, and the typed
`Manifest` every service reads (see docs/manifest.md)."""

from services.manifest.parse import MAX_MANIFEST_BYTES, parse_manifest, validate
from services.manifest.schema import schema
from services.manifest.types import (
    Checkpoint,
    DataStore,
    Elastic,
    Framework,
    Manifest,
    ManifestError,
    Pipeline,
    Resources,
    parse_memory_mb,
    safe_name,
    schema_default,
)

__all__ = [
    "MAX_MANIFEST_BYTES",
    "Checkpoint",
    "DataStore",
    "Elastic",
    "Framework",
    "Manifest",
    "ManifestError",
    "Pipeline",
    "Resources",
    "parse_manifest",
    "parse_memory_mb",
    "safe_name",
    "schema",
    "schema_default",
    "validate",
]
