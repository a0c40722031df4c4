"""The packages: every evalsuite* folder, as pyproject's `packages.find` listed them, plus evalsuite.tasks, whose
files are the top-level tasks/ (pyproject's package-dir maps it; find cannot see it). The rest is in pyproject.toml."""
import os

from setuptools import find_namespace_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
setup(packages=[*find_namespace_packages(HERE, include=["evalsuite", "evalsuite.*"]), "evalsuite.tasks"])
