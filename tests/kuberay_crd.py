"""KubeRay's RayCluster schema for the chart's tests (tests/helm): read from the shared folder beside the repository
(``../shared/k8s/crds``); a test that asks for it is skipped, saying so, where that folder is absent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

CRDS = Path(__file__).resolve().parents[2] / "shared" / "k8s" / "crds"


def raycluster_schema() -> tuple[Any, dict[str, Any]]:
    """``(jsonschema module, the RayCluster v1 OpenAPI schema)``; skips the test when either is missing."""
    jsonschema = pytest.importorskip("jsonschema")
    crd_file = CRDS / "ray.io_rayclusters.yaml"
    if not crd_file.exists():
        pytest.skip(f"KubeRay's CRD is not here ({crd_file}); it lives in the shared folder beside the repository")
    crd = yaml.safe_load(crd_file.read_text())
    return jsonschema, next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
