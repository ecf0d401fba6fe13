"""The published manifest schema (`schema.json` beside this module), loaded once."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def schema() -> dict[str, Any]:
    text = resources.files("services.manifest").joinpath("schema.json").read_text()
    loaded: dict[str, Any] = json.loads(text)
    return loaded
