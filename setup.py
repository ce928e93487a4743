"""Builds the optional C++ hot paths in csrc/: the bin packer and the CPU varlen attention kernel.
No torch at build time; a failed compile is not fatal (`optional=True`) because every compiled
routine has a pure-Python/PyTorch fallback in packing/."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "packing._packer",
        ["csrc/packer.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
        optional=True,
    ),
    Pybind11Extension(
        "packing._varlen_attention",
        ["csrc/varlen_attention.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-tree-loop-distribute-patterns"],
        extra_link_args=["-fopenmp"],
        optional=True,
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
