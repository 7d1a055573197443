"""The one compiled piece: the fused low-rank decode and round update (common/wire/_kernels.c), optional.

Everything else is in pyproject.toml. The extension is built with IEEE arithmetic kept exactly as
written (-ffp-contract=off: no fused multiply-add; no -ffast-math): its results must equal the torch
form bit for bit on every machine (docs/decisions.md, "The exchange at the hardware's speed"). `optional=True`: where
no C
compiler is there, the install goes on and the decode runs the torch form, with the same bits.
"""

from setuptools import Extension, setup

KERNELS = Extension(
    "dilocox.common.wire._kernels",
    sources=["common/wire/_kernels.c"],
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c11"],
    optional=True,
)

setup(ext_modules=[KERNELS])
