"""The optional compiled piece: hixl._fastwire (hixl/_fastwire.c), the socket data path's
lone op in C on both sides (docs/data-path.md §4). Everything else is in pyproject.toml.

`optional=True`: without a C compiler or the Python headers the build is skipped (with a
warning) and hixl runs the same path in pure Python; HIXL_FASTWIRE=0 forces that too.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hixl._fastwire", ["hixl/_fastwire.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Wextra",
                                                 "-Wno-missing-field-initializers",
                                                 "-Wno-unused-parameter"])])
