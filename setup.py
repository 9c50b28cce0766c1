"""Build the native update kernel at install time (metadata lives in pyproject.toml).

The extension is optional: without a C compiler the install still succeeds and the callback
uses its pure-torch kernel, and says so in one log line.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "deadweight.callbacks.update._update_kernel",
            sources=["callbacks/update/_update_kernel.c"],
            extra_compile_args=["-O3", "-fopenmp-simd", "-fno-math-errno"],
            optional=True,
        )
    ]
)
