"""Reading the project's YAML files (gates, sweeps) with one-line errors."""
from __future__ import annotations

import os

import yaml


def read_yaml(path: str, what: str, doc: str):
    """The parsed file; a missing file or bad YAML is one line naming `what` and the `doc` to read."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path} not found; see {doc} for the format")
    with open(path) as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ValueError(f"{what} {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
