"""One version for the library: the CMake project's (CMakeLists.txt), the
Python package's (pagedkv.__version__) and what pip installed (its metadata,
which pyproject.toml reads from pagedkv/__init__.py)."""
import os
import re
from importlib.metadata import version as installed_version

import pagedkv
from conftest import REPO


def cmake_project_version():
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        match = re.search(r"project\(pagedkv VERSION ([0-9.]+)", f.read())
    assert match, "CMakeLists.txt: no 'project(pagedkv VERSION x.y.z' line"
    return match.group(1)


def test_the_package_version_is_the_cmake_project_version():
    assert pagedkv.__version__ == cmake_project_version()


def test_the_installed_metadata_has_that_version():
    assert installed_version("pagedkv") == pagedkv.__version__
