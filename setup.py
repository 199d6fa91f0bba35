"""The one thing pyproject.toml cannot say on every setuptools >= 68: ecd's optional C extension.

ecd._copy (ecd/_copy.c) is the client's copy into pool memory with non-temporal stores for large
copies (ecd/client/tensors.py). optional=True: where there is no C compiler or no Python headers
the build says so and ecd installs without it, and copies go through numpy (memcpy) instead.
An editable install (`pip install -e .`, what `make test` does) builds it in place, next to the
source; `make` rebuilds it when the source changes.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ecd._copy", sources=["ecd/_copy.c"], optional=True,
                             extra_compile_args=["-O2"])])
