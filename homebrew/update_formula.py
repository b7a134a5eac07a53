"""Fill the Homebrew formula's url, version and sha256 from a built release tarball.

The release workflow runs this on the tarball it has just built and signed:

    python homebrew/update_formula.py build/dist/afmd-0.1.0-macos-arm64.tar.gz \\
        --repo OWNER/NAME [--tag v0.1.0] [--formula homebrew/afmd.rb] [--output FILE]

or with ``--url URL`` instead of ``--repo`` for a download location elsewhere. The version
comes from the tarball's name (``afmd-<version>-macos-arm64.tar.gz``, as build/build.py names
it); the sha256 is computed from the file and, when a ``.sha256`` file lies next to it, must
agree with it. Standard library only; exits 0 on success, 2 on bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMULA = ROOT / "homebrew" / "afmd.rb"
TARBALL_NAME = re.compile(r"^afmd-(?P<version>\d+\.\d+\.\d+(?:[.-][0-9A-Za-z.]+)?)"
                          r"-(?P<os>[a-z]+)-(?P<arch>[a-z0-9_]+)\.tar\.gz$")


class UpdateError(Exception):
    """Bad input: the message says what to fix."""


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def parse_tarball_name(name: str) -> str:
    """The version in ``afmd-<version>-macos-arm64.tar.gz``; other platforms are refused
    because the formula is for Apple Silicon Macs only."""
    match = TARBALL_NAME.match(name)
    if match is None:
        raise UpdateError(f"{name}: not named afmd-<version>-<os>-<arch>.tar.gz")
    if (match["os"], match["arch"]) != ("macos", "arm64"):
        raise UpdateError(f"{name}: the formula installs the macos-arm64 build, not "
                          f"{match['os']}-{match['arch']}")
    return match["version"]


def _replace_line(text: str, key: str, value: str) -> str:
    pattern = re.compile(rf'^(  {key} )"[^"\n]*"$', re.MULTILINE)
    found = len(pattern.findall(text))
    if found != 1:
        raise UpdateError(f"formula: expected exactly one `{key} \"...\"` line, found {found}")
    return pattern.sub(lambda m: f'{m.group(1)}"{value}"', text)


def update(text: str, *, url: str, version: str, sha256: str, homepage: str | None) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise UpdateError(f"not a sha256: {sha256!r}")
    text = _replace_line(text, "url", url)
    text = _replace_line(text, "version", version)
    text = _replace_line(text, "sha256", sha256)
    if homepage is not None:
        text = _replace_line(text, "homepage", homepage)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tarball", type=Path, help="afmd-<version>-macos-arm64.tar.gz")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--repo", help="GitHub OWNER/NAME whose release holds the tarball")
    where.add_argument("--url", help="the tarball's download URL")
    parser.add_argument("--tag", help="release tag (default v<version>)")
    parser.add_argument("--formula", type=Path, default=FORMULA, help="formula to read")
    parser.add_argument("--output", type=Path, help="where to write (default: --formula)")
    args = parser.parse_args(argv)
    try:
        if not args.tarball.is_file():
            raise UpdateError(f"{args.tarball}: no such file")
        version = parse_tarball_name(args.tarball.name)
        digest = sha256_of(args.tarball)
        sidecar = args.tarball.with_name(args.tarball.name + ".sha256")
        if sidecar.is_file():
            recorded = sidecar.read_text().split()[0]
            if recorded != digest:
                raise UpdateError(f"{sidecar}: records {recorded}, but the tarball's sha256 "
                                  f"is {digest}")
        homepage = None
        if args.repo is not None:
            if not re.fullmatch(r"[\w.-]+/[\w.-]+", args.repo):
                raise UpdateError(f"--repo {args.repo!r} is not OWNER/NAME")
            tag = args.tag or f"v{version}"
            url = (f"https://github.com/{args.repo}/releases/download/{tag}/"
                   f"{args.tarball.name}")
            homepage = f"https://github.com/{args.repo}"
        else:
            url = args.url
        text = update(args.formula.read_text(encoding="utf-8"), url=url, version=version,
                      sha256=digest, homepage=homepage)
    except UpdateError as exc:
        print(f"update_formula: {exc}", file=sys.stderr)
        return 2
    output = args.output or args.formula
    output.write_text(text, encoding="utf-8")
    print(f"{output}: version {version}, url {url}, sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
