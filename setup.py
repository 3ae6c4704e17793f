"""Package metadata for sglang-k3.

`kernels/` and `patches/` live at the top level of the repository (see DESIGN.md) but are
installed as `sglang_k3.kernels` and `sglang_k3.patches`: a top-level package called
`kernels` would shadow the PyPI package `kernels` that sglang itself imports.
"""

from setuptools import find_packages, setup

_inner = find_packages(include=["sglang_k3", "sglang_k3.*"])
_kernels = ["sglang_k3.kernels"] + ["sglang_k3.kernels." + p for p in find_packages(where="kernels")]
_patches = ["sglang_k3.patches"] + ["sglang_k3.patches." + p for p in find_packages(where="patches")]

setup(
    name="sglang-k3",
    version="0.1.0",
    description="A KDA-aware state cache for hybrid linear-attention models on SGLang",
    python_requires=">=3.10",
    packages=_inner + _kernels + _patches,
    package_dir={
        "sglang_k3": "sglang_k3",
        "sglang_k3.kernels": "kernels",
        "sglang_k3.patches": "patches",
    },
    package_data={"sglang_k3": ["assets/**/*"]},
    install_requires=[
        "sglang==0.5.23",
        "torch==2.14.1",
    ],
    extras_require={
        "test": [
            "pytest",
            "hypothesis",
            "requests",
            "fla-core==0.6.0",
            "ruff==0.17.6",
            "mooncake-transfer-engine-non-cuda==0.3.13.post1",
            "sglang-router==0.3.2",
        ],
        "bench": ["matplotlib", "tqdm"],
        # --k3-mooncake (the L3 tier); the wheel needs the system's libibverbs1 (apt-get install libibverbs1)
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        # scripts/start_fleet.py and python -m sglang_k3.fleet.launch_router (the fleet)
        "fleet": ["mooncake-transfer-engine-non-cuda==0.3.13.post1", "sglang-router==0.3.2"],
    },
    entry_points={
        "sglang.srt.platforms": ["k3_cpu = sglang_k3.integration.platform_entry:activate"],
        "sglang.srt.plugins": ["k3 = sglang_k3.integration.plugin:load"],
    },
)
