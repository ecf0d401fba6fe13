"""The submit page's server side: the examples a user can pick, and where a manifest's
problem belongs on the form."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.manifest import ManifestError, parse_manifest

# The repository's examples/ (present in a checkout and an editable install; an installed
# wheel has none, and the page then offers only uploads).
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


@dataclass(frozen=True)
class Example:
    name: str  # the folder's name, e.g. "mnist"
    folder: Path
    manifest_file: Path

    @property
    def manifest(self) -> str:
        return self.manifest_file.read_text()


def examples(root: Path = EXAMPLES_DIR) -> dict[str, Example]:
    """The example folders with a manifest (manifest.yml or manifest.yaml), by name."""
    found: dict[str, Example] = {}
    if not root.is_dir():
        return found
    for folder in sorted(root.iterdir()):
        for name in ("manifest.yml", "manifest.yaml"):
            if (folder / name).is_file():
                found[folder.name] = Example(folder.name, folder, folder / name)
                break
    return found


def manifest_problem(text: str) -> dict[str, str]:
    """{} for a manifest the API would take, else {"field", "problem", "message"}: the
    dotted path of the wrong field (empty for a document that is not YAML) and why."""
    if not text.strip():
        return {"field": "", "problem": "the manifest is empty", "message": "the manifest is empty"}
    try:
        parse_manifest(text)
    except ManifestError as exc:
        return {"field": exc.field, "problem": exc.problem, "message": str(exc)}
    return {}
