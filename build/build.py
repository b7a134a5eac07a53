"""Build the frozen ``afmd`` binary with PyInstaller and package it for release.

    .venv/bin/python build/build.py                    # onedir build → tarball (the default)
    .venv/bin/python build/build.py --mode onefile     # one self-extracting binary instead
    .venv/bin/python build/build.py --sign             # macOS: codesign (and notarize) first

Outputs, in ``--out`` (default ``build/dist``), named after the version and platform:

- onedir (default): ``afmd-<version>-<os>-<arch>/`` (``afmd``, ``_internal/``,
  ``config.example.toml``), the same folder as ``afmd-<version>-<os>-<arch>.tar.gz``, and
  ``afmd-<version>-<os>-<arch>.tar.gz.sha256``;
- onefile: the binary ``afmd-<version>-<os>-<arch>`` and ``afmd-<version>-<os>-<arch>.sha256``.

The ``.sha256`` files use the ``sha256sum``/``shasum -a 256 -c`` format. ``--json`` prints
a summary (paths, sizes, digest, build seconds) as the last line of output, for tools.

onedir is the default because a onefile binary unpacks its whole payload (about 200 MB)
into a temporary folder on every start: ``afmd version`` took 4.1–5.6 s onefile against
0.3 s onedir here (numbers and commands in docs/distribution.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "build" / "afmd.spec"
SIGN = ROOT / "build" / "sign.sh"
REQUIREMENTS = ROOT / "build" / "requirements.txt"
EXTRA_FILES = ("config.example.toml",)

_OS_NAMES = {"darwin": "macos", "linux": "linux"}
_ARCH_NAMES = {"arm64": "arm64", "aarch64": "arm64", "x86_64": "x86_64", "amd64": "x86_64"}


def afmd_version() -> str:
    """The version in afmd/__init__.py, read without importing the package."""
    text = (ROOT / "afmd" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if match is None:
        raise SystemExit("build.py: no __version__ in afmd/__init__.py")
    return match.group(1)


def platform_tag(system: str | None = None, machine: str | None = None) -> tuple[str, str]:
    """(os, arch) as they appear in artifact names: ("macos", "arm64"), ("linux", "x86_64")."""
    system = sys.platform if system is None else system
    machine = (platform.machine() if machine is None else machine).lower()
    os_name = _OS_NAMES.get(system)
    arch = _ARCH_NAMES.get(machine)
    if os_name is None or arch is None:
        raise SystemExit(f"build.py: unsupported platform {system}/{machine}")
    return os_name, arch


def artifact_name(version: str | None = None, system: str | None = None,
                  machine: str | None = None) -> str:
    os_name, arch = platform_tag(system, machine)
    return f"afmd-{version or afmd_version()}-{os_name}-{arch}"


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_sha256(path: Path) -> tuple[Path, str]:
    """Write ``<path>.sha256`` ("<hex>  <name>\\n", checkable with ``shasum -a 256 -c``)."""
    hexdigest = sha256_of(path)
    sidecar = path.with_name(path.name + ".sha256")
    sidecar.write_text(f"{hexdigest}  {path.name}\n", encoding="ascii")
    return sidecar, hexdigest


def ensure_pyinstaller(install: bool) -> None:
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        if not install:
            raise SystemExit(
                "build.py: PyInstaller is not installed; run "
                f"`{sys.executable} -m pip install -r {REQUIREMENTS.relative_to(ROOT)}` "
                "or pass --install-build-deps"
            ) from None
        print(f"build.py: installing build tools from {REQUIREMENTS}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)], check=True
        )


def run_pyinstaller(mode: str, work: Path, dist: Path, log_level: str) -> Path:
    """Run the spec; return the onedir folder or the onefile binary."""
    if dist.exists():
        shutil.rmtree(dist)
    cmd = [
        sys.executable, "-m", "PyInstaller", "--noconfirm",
        "--log-level", log_level, "--workpath", str(work), "--distpath", str(dist),
        str(SPEC), "--", "--mode", mode, "--name", "afmd",
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)
    built = dist / "afmd"
    if not built.exists():
        raise SystemExit(f"build.py: PyInstaller did not produce {built}")
    return built


def sign(path: Path) -> None:
    subprocess.run(["bash", str(SIGN), str(path)], check=True)


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Reproducible ownership; users unpack as themselves.
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def package_onedir(built: Path, out: Path, name: str) -> Path:
    """Lay out ``out/name/`` (the app plus config example) and tar it as ``name.tar.gz``."""
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(built, folder, symlinks=True)
    for extra in EXTRA_FILES:
        shutil.copy2(ROOT / extra, folder / extra)
    tarball = out / f"{name}.tar.gz"
    with tarfile.open(tarball, "w:gz", compresslevel=6) as tar:
        tar.add(folder, arcname=name, filter=_tar_filter)
    return tarball


def package_onefile(built: Path, out: Path, name: str) -> Path:
    binary = out / name
    shutil.copy2(built, binary)
    return binary


def tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def build(mode: str = "onedir", out: Path | None = None, work: Path | None = None, *,
          do_sign: bool = False, install_deps: bool = False,
          log_level: str = "WARN") -> dict[str, object]:
    """Build and package; return the summary ``--json`` prints."""
    out = (ROOT / "build" / "dist") if out is None else out
    work = (ROOT / "build" / "work") if work is None else work
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    ensure_pyinstaller(install_deps)
    name = artifact_name()
    started = time.monotonic()
    built = run_pyinstaller(mode, work / f"pyinstaller-{mode}", work / f"dist-{mode}", log_level)
    build_s = time.monotonic() - started
    if do_sign:
        sign(built)
    if mode == "onedir":
        artifact = package_onedir(built, out, name)
        executable = out / name / "afmd"
    else:
        artifact = package_onefile(built, out, name)
        executable = artifact
    sidecar, hexdigest = write_sha256(artifact)
    return {
        "mode": mode,
        "name": name,
        "version": afmd_version(),
        "artifact": str(artifact),
        "artifact_bytes": artifact.stat().st_size,
        "sha256": hexdigest,
        "sha256_file": str(sidecar),
        "executable": str(executable),
        "installed_bytes": tree_size(out / name) if mode == "onedir" else artifact.stat().st_size,
        "pyinstaller_s": round(build_s, 1),
        "total_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("onedir", "onefile"), default="onedir",
                        help="onedir (default): a folder in a tarball; onefile: one binary")
    parser.add_argument("--out", type=Path, help="output folder (default build/dist)")
    parser.add_argument("--work", type=Path, help="PyInstaller work folder (default build/work)")
    parser.add_argument("--sign", action="store_true",
                        help="run build/sign.sh on the build before packaging (macOS only)")
    parser.add_argument("--install-build-deps", action="store_true",
                        help=f"pip-install {REQUIREMENTS.name} first if PyInstaller is missing")
    parser.add_argument("--log-level", default="WARN", help="PyInstaller log level")
    parser.add_argument("--json", action="store_true", help="print a JSON summary last")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONHASHSEED", "0")  # stable bytecode/archives across builds
    summary = build(args.mode, args.out, args.work, do_sign=args.sign,
                    install_deps=args.install_build_deps, log_level=args.log_level)
    print(f"built {summary['artifact']} ({summary['artifact_bytes'] / 1e6:.1f} MB, "
          f"sha256 {summary['sha256']}) in {summary['total_s']} s")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
