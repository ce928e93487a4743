"""Builds the optional C++ hot paths in csrc/: the bin packer and the CPU varlen attention kernel.
No torch at build time; a failed compile is not fatal (`optional=True`) because every compiled
routine has a pure-Python/PyTorch fallback in packing/."""

import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "nopad.packing._packer",
        ["csrc/packer.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
        optional=True,
    ),
    Pybind11Extension(
        "nopad.packing._varlen_attention",
        ["csrc/varlen_attention.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-tree-loop-distribute-patterns"],
        extra_link_args=["-fopenmp"],
        optional=True,
    ),
]

WHAT = {
    "nopad.packing._packer": "the bin packer (csrc/packer.cpp)",
    "nopad.packing._varlen_attention": "the CPU varlen/paged attention kernel (csrc/varlen_attention.cpp)",
}


class BuildNopad(build_ext):
    """Says what it compiles and that it takes a while: a silent minutes-long step reads as a hang."""

    def build_extension(self, ext):
        message = (
            f"nopad: compiling {WHAT.get(ext.name, ext.name)} -> {ext.name}; a few minutes on a "
            "2-core machine (a failure is not fatal: packing/ falls back to Python/PyTorch)"
        )
        print(message, file=sys.stderr, flush=True)
        super().build_extension(ext)


setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildNopad})
