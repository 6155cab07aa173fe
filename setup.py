"""Build script for lamina.

The pure-Python package (``python/lamina``) and the Triton kernels (``kernels/``,
imported as ``lamina.kernels``) need no compilation. The C++/CUDA extension
``lamina._C`` is built only when asked for:

* ``LAMINA_BUILD_CUDA=1``: CUDA kernels plus the CPU kernels (needs nvcc and a CUDA build of torch);
* ``LAMINA_BUILD_CPU=1``: the CPU C++ kernels only.

torch is imported only in those two cases, so a plain ``pip install -e .`` works on
any machine, with or without a GPU.
"""

import glob
import os
import runpy

from setuptools import find_packages, setup

# The tested dependency ranges live in the package (``lamina info`` checks them at run time).
VERSIONS = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "python", "lamina", "_versions.py"))

BUILD_CUDA = os.environ.get("LAMINA_BUILD_CUDA", "0") == "1"
BUILD_CPU = os.environ.get("LAMINA_BUILD_CPU", "0") == "1"


def extension_modules():
    if not (BUILD_CUDA or BUILD_CPU):
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cpp_sources = sorted(glob.glob("csrc/*.cpp"))
    # at::parallel_for runs the CPU kernels over the cores only when the extension is built with OpenMP
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
    link_flags = ["-fopenmp"]
    if BUILD_CUDA:
        cu_sources = sorted(glob.glob("csrc/*.cu"))
        ext = CUDAExtension(
            "lamina._C",
            cpp_sources + cu_sources,
            define_macros=[("LAMINA_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--use_fast_math"]},
            extra_link_args=link_flags,
        )
    else:
        ext = CppExtension("lamina._C", cpp_sources, extra_compile_args=cxx_flags, extra_link_args=link_flags)
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = extension_modules()

setup(
    name="lamina",
    version="0.1.0",
    description="Triton and CUDA kernels for delta-rule recurrences, Prism attention and HRM-LM",
    python_requires=">=3.10",
    package_dir={"lamina": "python/lamina", "lamina.kernels": "kernels"},
    # every package under python/lamina (a wheel holds only the packages listed here), and the kernels
    packages=["lamina", "lamina.kernels", *(f"lamina.{p}" for p in find_packages("python/lamina"))],
    # the attention dispatch table of a committed GPU sweep (lamina.ops.attention_dispatch), once there is one
    package_data={"lamina": ["data/*.json"]},
    install_requires=[VERSIONS["TORCH_REQUIREMENT"], VERSIONS["TRITON_REQUIREMENT"], "einops>=0.7", "numpy"],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist",
            "hypothesis",
            "pytest-benchmark",
            "fla-core==0.6.0",
            # fla's layers and models (tests/test_fla_*.py compare lamina's layers with them); transformers
            # pinned: from some 5.x release on, generate() passes the cache as `cache=`, which fla 0.6's models
            # ignore (decoding without state), while 5.17 passes `past_key_values=` as fla expects
            "flash-linear-attention==0.6.0",
            "transformers==5.17.0",
            "ruff",
            "matplotlib",  # tests/test_bench_cli.py renders `lamina bench plot` PNGs
            # the device check's dry run (tests/test_bench_device_check.py) and the CPU extension build
            # install lamina with --no-build-isolation, which needs the build backend in the environment
            "setuptools>=64",
            "wheel",
        ],
        "bench": ["matplotlib", "rich"],
    },
    entry_points={"console_scripts": ["lamina=lamina.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
