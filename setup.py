"""The kernel sources live in the top-level ``custom_ops/``; an installed package (wheel, sdist,
``pip install .``) carries them as ``tf_sparsify/ops/src/`` so ``python -m tf_sparsify.ops.build``
finds them there. The Horovod installer ``tf_sparsify/install_horovod.sh`` (``python -m
tf_sparsify install-horovod``) is package data. Everything else is in ``setup.cfg``."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["tf_sparsify", "tf_sparsify.*"]), "tf_sparsify.ops.src"],
    package_dir={"tf_sparsify.ops.src": "custom_ops"},
    package_data={
        "tf_sparsify": ["install_horovod.sh"],
        "tf_sparsify.ops.src": [
            "cc/ops/*.cc",
            "cc/kernels/*.cc",
            "cc/kernels/*.h",
            "cuda/*",
            "include/*.h",
        ],
    },
)
