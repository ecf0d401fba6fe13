"""Render charts/rhizome into plain manifests, for clusters without Helm.

    .venv/bin/python deploy/kubernetes/render.py          # rewrites deploy/kubernetes/rhizome.yaml
    .venv/bin/python deploy/kubernetes/render.py --check  # exit 1 if the file is stale

Rendered through helm-python-sdk (Helm's own Go SDK, no `helm` binary) with the values
below: everything bundled (etcd, a single-node MongoDB and Elasticsearch), release
`rhizome` in namespace `rhizome`. tests/kubernetes/test_chart.py fails when the committed
file differs from a fresh render.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import helm_python
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rhizome"
OUTPUT = Path(__file__).resolve().parent / "rhizome.yaml"
RELEASE, NAMESPACE = "rhizome", "rhizome"
PLAIN_VALUES: dict[str, Any] = {"mongodb": {"bundled": True}, "elasticsearch": {"bundled": True}}


def render(
    values: dict[str, Any] | None = None, name: str = RELEASE, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    """Every object the chart renders with these values, in template order."""
    chart = helm_python.Chart.load(str(CHART))
    rendered = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
    objects: list[dict[str, Any]] = []
    for path in sorted(rendered):
        if not path.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for doc in yaml.safe_load_all(rendered[path]):
            if doc:
                objects.append(doc)
    return objects


def plain_manifest() -> str:
    head = (
        "# Rendered from charts/rhizome by deploy/kubernetes/render.py; do not edit.\n"
        "# kubectl create namespace rhizome && kubectl apply -f deploy/kubernetes/rhizome.yaml\n"
    )
    body = "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in render(PLAIN_VALUES))
    return head + "---\n" + body


def main(argv: list[str]) -> int:
    text = plain_manifest()
    if "--check" in argv:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(
                f"{OUTPUT} is stale: run .venv/bin/python deploy/kubernetes/render.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
