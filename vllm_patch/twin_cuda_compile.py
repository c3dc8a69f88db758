"""The CUDA kernel's static compile check (no GPU): every instance of ``csrc/twin_w4a16.cuh`` compiled for a
GPU architecture, with ptxas's registers, spills, stack and shared memory per instance.

Two compilers, the same source and the same ptxas report:

* ``nvcc`` (the GPU host's, or any CUDA toolkit on PATH): the kernel's own host launch code too;
* NVRTC, where no ``nvcc`` is there: the runtime compiler library that torch's CUDA wheels install
  (``nvidia-cuda-nvrtc``, with the CUDA headers of ``nvidia-cuda-runtime``), loaded with ctypes. It compiles
  device code only, so the source guards its host part with ``__CUDACC_RTC__`` and the check instantiates
  the kernels themselves (``TWIN_W4_INSTANTIATE_KERNEL``). So a CPU host with the project's environment,
  CI included, compiles the kernel for ``sm_90a`` and sees each instance's registers and spills before a
  GPU lease is spent on it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_MANGLED = re.compile(r"w4a16_decodeILi(\d)ELi(\d)ELi(\d)ELb(\d)ELb(\d)E")
_MANGLED_PIPE = re.compile(r"w4a16_decode_pipeILi(\d)ELi(\d)ELi(\d)ELb(\d)E")
_MANGLED_BULK = re.compile(r"w4a16_decode_bulkILi(\d)ELi(\d)ELi(\d)ELb(\d)E")
# NVRTC has no <stdint.h>: the fixed-width types the kernel uses
_RTC_PRELUDE = ("typedef unsigned char uint8_t;\ntypedef unsigned short uint16_t;\ntypedef unsigned int uint32_t;\n"
                "typedef unsigned long long uint64_t;\ntypedef long long int64_t;\ntypedef unsigned long long uintptr_t;\n")


def instance_name(r: int, nt: int, gs: int, z: bool, deep: bool = False, pipe: bool = False,
                  bulk: bool = False) -> str:
    return (f"r{r}-nt{nt}-g{32 * gs}-{'zp' if z else 'sym'}" + ("-deep" if deep else "") + ("-pipe" if pipe else "")
            + ("-bulk" if bulk else ""))


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """ptxas ``-v``'s report, one entry per kernel instance: registers, spill bytes, stack, shared memory."""
    info = {}
    for b in log.split("Compiling entry function")[1:]:
        m, pipe, bulk = _MANGLED.search(b), False, False
        if m is None:
            m, pipe = _MANGLED_PIPE.search(b), True
        if m is None:
            m, pipe, bulk = _MANGLED_BULK.search(b), False, True
        regs = re.search(r"Used (\d+) registers", b)
        spill = _SPILL.search(b)
        stack = re.search(r"(\d+) bytes stack frame", b)
        smem = re.search(r"(\d+) bytes smem", b)
        if regs and m is None and "w4a16_dequant" in b.split("\n", 1)[0]:
            info["dequant"] = _facts(regs, spill, stack, smem)
        if not m or not regs:
            continue
        r, nt, gs, z, *deep = (int(v) for v in m.groups())
        info[instance_name(r, nt, gs, bool(z), bool(deep and deep[0]), pipe, bulk)] = _facts(regs, spill, stack, smem)
    return info


def _facts(regs, spill, stack, smem) -> dict[str, int]:
    return {"regs": int(regs.group(1)), "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else 0,
            "stack_bytes": int(stack.group(1)) if stack else 0, "smem_bytes": int(smem.group(1)) if smem else 0}


def _instantiations(kernel: bool, instances=None, pipe_instances=None, bulk_instances=None) -> str:
    """The source that instantiates ``instances`` ((R, NT, group / 32, zero points, deep) tuples), the staged
    kernel's ``pipe_instances`` and the TMA-fed kernel's ``bulk_instances`` ((R, NT, group / 32, zero points));
    None: every one. ``kernel``: the kernels themselves (NVRTC), else their host launchers (nvcc)."""
    suffix = "_KERNEL" if kernel else ""
    out = ('#include "twin_w4a16_pipe.cuh"\n#include "twin_w4a16_bulk.cuh"\n#include "twin_w4a16_dequant.cuh"\n'
           "namespace twin_w4 {\n")
    if instances is None:
        out += f"TWIN_W4_FOR_EACH(TWIN_W4_INSTANTIATE{suffix})\n"
    else:
        out += "".join(f"TWIN_W4_INSTANTIATE{suffix}({r}, {nt}, {gs}, {str(z).lower()}, {str(d).lower()})\n"
                       for r, nt, gs, z, d in instances)
    if pipe_instances is None:
        out += f"TWIN_W4_PIPE_FOR_EACH(TWIN_W4_INSTANTIATE_PIPE{suffix})\n"
    else:
        out += "".join(f"TWIN_W4_INSTANTIATE_PIPE{suffix}({r}, {nt}, {gs}, {str(z).lower()})\n"
                       for r, nt, gs, z in pipe_instances)
    if bulk_instances is None:
        out += f"TWIN_W4_BULK_FOR_EACH(TWIN_W4_INSTANTIATE_BULK{suffix})\n"
    else:
        out += "".join(f"TWIN_W4_INSTANTIATE_BULK{suffix}({r}, {nt}, {gs}, {str(z).lower()})\n"
                       for r, nt, gs, z in bulk_instances)
    return out + "}\n"


def compile_cubin(out_dir: Path, arch: str = "sm_90a", nvcc: str = "nvcc", instances=None,
                  pipe_instances=None, bulk_instances=None, csrc: Path = CSRC) -> tuple[Path, dict]:
    """The instances (all: None) compiled by ``nvcc`` (no torch headers) to one cubin; ``{instance: ptxas facts}``.
    ``csrc``: the kernel's source folder (another revision's, for a side-by-side compile)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "twin_w4a16_all.cu"
    src.write_text(_instantiations(False, instances, pipe_instances, bulk_instances))
    cubin = out_dir / f"twin_w4a16_{arch}.cubin"
    res = subprocess.run([nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-I", str(csrc),
                          "-o", str(cubin), str(src)], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"nvcc failed:\n{res.stderr[-4000:]}")
    return cubin, parse_ptxas(res.stderr)


def nvrtc_paths() -> tuple[Path, Path] | None:
    """(``libnvrtc``, the CUDA include folder) of the installed NVIDIA wheels, newest CUDA first; None."""
    for pkg, lib_glob in (("nvidia.cu13", "libnvrtc.so.13"), ("nvidia.cuda_nvrtc", "libnvrtc.so.12")):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        roots = list(spec.submodule_search_locations or []) if spec else []
        for root in map(Path, roots):
            lib = root / "lib" / lib_glob
            inc = root / "include" if (root / "include" / "cuda_bf16.h").is_file() else None
            if inc is None:  # CUDA 12's split wheels: the headers are nvidia-cuda-runtime's
                rt = importlib.util.find_spec("nvidia.cuda_runtime")
                cand = [Path(p) / "include" for p in (rt.submodule_search_locations or [])] if rt else []
                inc = next((c for c in cand if (c / "cuda_bf16.h").is_file()), None)
            if lib.is_file() and inc is not None:
                return lib, inc
    return None


def _nvrtc(lib_path: Path):
    for builtins in sorted(lib_path.parent.glob("libnvrtc-builtins.so.*")):
        if "alt" not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)  # NVRTC opens it by name at compile time
            break
    return ctypes.CDLL(str(lib_path))


def nvrtc_compile(source: str, arch: str, include_dirs: list[Path], lib_path: Path) -> tuple[bytes, str]:
    """``source`` compiled by NVRTC to a cubin for ``arch`` with ptxas ``-v``: (cubin, the program log)."""
    lib = _nvrtc(lib_path)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"twin_w4a16_rtc.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v", "-default-device"]
        opts += [f"-I{d}" for d in include_dirs]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if rc:
            raise RuntimeError(f"NVRTC failed ({rc}):\n{text[-4000:]}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw, text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_cubin_nvrtc(out_dir: Path, arch: str = "sm_90a", instances=None, pipe_instances=None,
                        bulk_instances=None, csrc: Path = CSRC) -> tuple[Path, dict]:
    """The kernel instances (all: None) compiled by NVRTC (the wheels' runtime compiler) to one cubin;
    ptxas facts. ``csrc``: the kernel's source folder."""
    paths = nvrtc_paths()
    if paths is None:
        raise RuntimeError("no NVRTC: neither nvidia-cuda-nvrtc (CUDA 13: nvidia/cu13) nor CUDA 12's wheels")
    lib, inc = paths
    src = _RTC_PRELUDE + _instantiations(True, instances, pipe_instances, bulk_instances)
    cubin, log = nvrtc_compile(src, arch, [Path(csrc), inc], lib)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"twin_w4a16_{arch}_nvrtc.cubin"
    path.write_bytes(cubin)
    return path, parse_ptxas(log)


def compiler() -> str | None:
    """What ``compile_check`` compiles with here: ``nvcc``, ``nvrtc`` or None."""
    if shutil.which("nvcc"):
        return "nvcc"
    return "nvrtc" if nvrtc_paths() is not None else None


def compile_check(out_dir: Path, arch: str = "sm_90a") -> dict:
    """Per-instance registers / spills / stack / shared memory, by ``nvcc`` where it is, else by NVRTC."""
    if compiler() == "nvcc":
        return compile_cubin(out_dir, arch)[1]
    return compile_cubin_nvrtc(out_dir, arch)[1]
