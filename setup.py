"""Build the compiled row store of the sparse tables (heterps_ray/ps/_rows.c); the rest of the
package's metadata is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "heterps_ray.ps._rows",
            ["heterps_ray/ps/_rows.c"],
            # -ffp-contract=off: no fused multiply-add, so Adagrad and the initial rows match numpy bit
            # for bit (the tests and the reference trainer check exact equality)
            extra_compile_args=["-O2", "-ffp-contract=off", "-std=c11", "-pthread"],
            extra_link_args=["-pthread"],  # the disk tier's reads in flight (pread_records)
        )
    ]
)
