"""Package discovery (the rest of the metadata is in setup.cfg).

properties/ stays at the repository's top level and ships inside the wheel as
the package data ``textbox_like/properties/`` (package_dir maps it), so a
non-editable ``pip install .`` keeps the task defaults and model presets.
textbox_like.config.PROPERTIES finds it there, or beside the package in a
source tree and an editable install.
"""
import os

from setuptools import find_namespace_packages, setup

PROPERTY_PACKAGES = ["textbox_like.properties" + root[len("properties"):].replace(os.sep, ".")
                     for root, _, _ in os.walk("properties")]

setup(
    # namespace-aware: textbox_like/data has no __init__.py
    packages=find_namespace_packages(include=["textbox_like", "textbox_like.*"], exclude=["*__pycache__*"])
    + PROPERTY_PACKAGES,
    package_dir={"textbox_like.properties": "properties"},
    package_data={name: ["*.yaml"] for name in PROPERTY_PACKAGES},
)
