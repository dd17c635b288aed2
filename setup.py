"""Package discovery for pyproject.toml's build (everything else is declared there).

kernels/, chaos/ and loadgen/ sit at the top of the repository but install inside tokstream
(`kernels` on PyPI is Hugging Face's package, which transformers imports when present), and
profiles/ ships as tokstream/profiles. pyproject.toml's `packages.find` cannot map folders to
other names, so every package under each folder is found here: a new subpackage needs no edit.
"""

from setuptools import find_namespace_packages, find_packages, setup

PACKAGE_DIRS = {"tokstream": "tokstream", "tokstream.kernels": "kernels",
                "tokstream.chaos": "chaos", "tokstream.loadgen": "loadgen"}
"""Installed package -> the folder it comes from."""


def packages() -> list[str]:
    found = []
    for package, folder in PACKAGE_DIRS.items():
        found += [package] + [f"{package}.{sub}" for sub in find_packages(folder)]
    # profiles/ holds TOML files only: each folder of it is a data package.
    found += ["tokstream.profiles"] + [f"tokstream.profiles.{sub}"
                                       for sub in find_namespace_packages("profiles")]
    return sorted(found)


setup(packages=packages(),
      package_dir={**PACKAGE_DIRS, "tokstream.profiles": "profiles"},
      package_data={"tokstream.kernels": ["*.c", "*.h"],
                    **{package: ["*.toml"] for package in packages()
                       if package.startswith("tokstream.profiles")}})
