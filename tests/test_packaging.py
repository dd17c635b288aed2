"""pyproject.toml lists every package folder (kernels/, chaos/, loadgen/ and profiles/ install
under tokstream, which packages.find cannot map, so the list is written by hand): a folder
missing from it installs from a checkout (-e) and breaks in a wheel (tests/test_deploy_wheel.py
builds one; this is the fast check)."""

import tomllib

from helpers.serving import ROOT


def folders_of(package: str, folder) -> set[str]:
    """Every package under `folder`: folders holding a __init__.py or (profiles) a .toml."""
    found = {package}
    for path in folder.rglob("*"):
        if path.is_dir() and "__pycache__" not in path.parts and (
                (path / "__init__.py").is_file() or any(path.glob("*.toml"))):
            found.add(package + "." + ".".join(path.relative_to(folder).parts))
    return found


def test_every_package_folder_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in setuptools["package-dir"].items():
        found |= folders_of(package, ROOT / folder)
    assert found == listed, {"missing": sorted(found - listed), "extra": sorted(listed - found)}
