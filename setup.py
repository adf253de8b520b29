"""Package layout only (metadata is in pyproject.toml): the top-level templates/ folder, subfolders included,
ships inside the wheel as alchemist/templates, and the kernels' C/C++ sources (alchemist/kernels/csrc) as package
data, so an installed alchemist needs no source tree."""

from setuptools import find_namespace_packages, setup

TEMPLATES = ["alchemist.templates"] + [f"alchemist.templates.{p}" for p in find_namespace_packages("templates")]

setup(
    packages=find_namespace_packages(include=["alchemist*"]) + TEMPLATES,
    package_dir={"alchemist.templates": "templates"},
    package_data={**{p: ["*.j2"] for p in TEMPLATES}, "alchemist.kernels.csrc": ["*.cpp", "*.h"]},
)
