"""Wheel tags: a wheel carrying the precompiled kernel library (kernels/shipped, built by
``qla-serving compile --shipped``) holds a Linux x86-64 shared object, so it is tagged for that
platform (any Python 3: the library is called through ctypes, not as an extension module)."""

import pathlib

from setuptools import setup

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

SHIPPED = pathlib.Path(__file__).parent / "kernels" / "shipped" / "manifest.json"


class LibraryWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = not SHIPPED.is_file()

    def get_tag(self):
        python, abi, plat = super().get_tag()
        return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)


setup(cmdclass={"bdist_wheel": LibraryWheel})
