"""The documentation holds together: every relative link lands, the README stays an entrance.

The README is the front page and the pages under ``docs/`` the manual; they link to each
other and to files of the tree by relative paths, which break silently when a page or a
heading is renamed. This reads every Markdown link and image in README.md, docs/*.md and
bench/README.md and checks that its file exists and that its ``#anchor`` is a heading of the
target, slugged as GitHub slugs headings; and that every file of the tree (``afmd/...``,
``tests/...``, ``bench/...``) or afmd name (``afmd.service.output_plan.model_formats``) a
page names in code still exists, since a rename leaves those behind as silently. It also
keeps the README short (a manual grows by pages, not by a longer front page), every config
key in the configuration page's table, and every row of the layering test's table in the
architecture page's.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

from afmd.config.sections import SECTIONS
from afmd.config.tables import ModelEntry, ServerTool

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
README_MAX_LINES = 400


def pages() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "bench" / "README.md",
        ROOT / "bench" / "results" / "history.md",
    ]


def _without_code(text: str) -> str:
    """The text with fenced blocks and inline code spans blanked, line numbers kept: a link
    or heading shown as code is an example, not a link."""
    out: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and marker:
            fence = marker.group(1)[0] * len(marker.group(1))
            out.append("")
        elif fence is not None:
            if stripped.startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(re.sub(r"(`+).+?\1", lambda m: " " * len(m.group(0)), line))
    return "\n".join(out)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, every character but letters, marks,
    digits, connector punctuation (``_``), ``-`` and spaces dropped, each space a hyphen;
    inline markup is read as its text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    kept = []
    for char in text:
        category = unicodedata.category(char)
        if char in "- " or category[0] in "LMN" or category == "Pc":
            kept.append(char)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, numbered ``-1``, ``-2`` on repeats, as on
    GitHub."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fence: str | None = None
    for line in path.read_text().splitlines():
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker:
            if fence is None:
                fence = marker.group(1)[0] * len(marker.group(1))
            elif stripped.startswith(fence):
                fence = None
            continue
        if fence is not None:
            continue
        heading = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = github_slug(heading.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


@dataclasses.dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: {self.target}"


def links(page: Path) -> Iterator[Link]:
    """Inline links and images, ``[text](target)`` and ``![alt](target "title")``, outside
    code; absolute URLs and ``mailto:`` are left to the reader."""
    text = _without_code(page.read_text())
    for number, line in enumerate(text.splitlines(), start=1):
        for match in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            yield Link(page, number, target)


def all_links() -> list[Link]:
    return [link for page in pages() for link in links(page)]


def test_the_pages_exist_and_have_links() -> None:
    # A reader that found nothing would pass everything below.
    assert (ROOT / "docs" / "architecture.md").is_file()
    found = all_links()
    assert len(found) > 40
    assert any("#" in link.target for link in found)


def broken_links(page: Path) -> list[str]:
    broken: list[str] = []
    for link in links(page):
        path_part, _, anchor = link.target.partition("#")
        target = (page.parent / path_part).resolve() if path_part else page
        if not target.exists():
            broken.append(f"{link.line}: {link.target}: no such file")
        elif anchor and target.suffix != ".md":
            broken.append(f"{link.line}: {link.target}: an anchor into a file that is not Markdown")
        elif anchor and anchor not in anchors(target):
            broken.append(f"{link.line}: {link.target}: no such heading in {target.name}")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#a-code-heading) [self](#page)\n"
        "[gone](missing.md) [no heading](other.md#nothing) ![img](img.png)\n"
        "`[in code](missing.md)`\n\n```\n[in a fence](missing.md)\n```\n"
        "[web](https://example.com/x.md)\n"
    )
    assert broken_links(page) == [
        "4: missing.md: no such file",
        "4: other.md#nothing: no such heading in other.md",
        "4: img.png: no such file",
    ]


def test_the_readme_stays_an_entrance() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_readme_keeps_the_two_commands() -> None:
    # The brief's contract: the first command serves the demo model, the second is the
    # whole suite, and .ci/run runs exactly the second.
    readme = (ROOT / "README.md").read_text()
    serve = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/afmd serve"
    suite = (
        "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && "
        ".venv/bin/python -m pytest -q"
    )
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, flags=re.S)
    assert blocks[:2] == [serve, suite]
    ci = (ROOT / ".ci" / "run").read_text().replace("pip install -q -e", "pip install -e")
    assert ci.rstrip().endswith(suite)  # the same command, pip told to be quiet


def _config_keys() -> set[str]:
    keys = {
        f"{section}.{f.name}"
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if not (section == "models" and f.name in ("aliases", "model"))
        and not (section == "tools" and f.name == "server")
    }
    keys |= {f"models.model.{f.name}" for f in dataclasses.fields(ModelEntry)}
    keys |= {f"tools.server.{f.name}" for f in dataclasses.fields(ServerTool)}
    return keys


def test_the_configuration_page_lists_every_key() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    listed = set(re.findall(r"^\| `([a-z_.]+)` \|", text, flags=re.M))
    keys = _config_keys()
    assert len(keys) > 40
    assert keys - listed == set(), "keys missing from docs/configuration.md's table"
    assert listed - keys - {"models.aliases"} == set(), "the table lists keys afmd does not have"


def test_the_slug_rules() -> None:
    assert github_slug("Completions and fill-in-the-middle (`/v1/completions`)") == (
        "completions-and-fill-in-the-middle-v1completions"
    )
    assert github_slug("Apple's on-device model (`system`)") == "apples-on-device-model-system"
    assert github_slug("Signing, notarization and the release (macOS; not runnable here)") == (
        "signing-notarization-and-the-release-macos-not-runnable-here"
    )
    assert github_slug("`[ollama] port`") == "ollama-port"
    assert github_slug("GPU mode (`bench/gpu.py`)") == "gpu-mode-benchgpupy"
    assert github_slug("Speed — measured × 2, naïve") == "speed--measured--2-naïve"


def _layering_table() -> tuple[tuple[str, float], ...]:
    """The (pattern, layer) table ``test_layering.py`` enforces, wherever under tests/ it is,
    read from its source (a literal)."""
    (path,) = ROOT.joinpath("tests").rglob("test_layering.py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(x, ast.Name) and x.id == "LAYERS" for x in targets):
                assert node.value is not None
                return ast.literal_eval(node.value)
    raise AssertionError(f"no LAYERS table in {path}")


def _documented_layers() -> dict[float, str]:
    """The architecture page's layer table: layer number → its row's folders and modules."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layer rules per folder", 1)[1].split("\n## ", 1)[0]
    rows: dict[float, str] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"[0-9.]+", cells[0]):
            rows[float(cells[0])] = cells[1]
    return rows


def test_the_architecture_page_places_every_module_as_the_layering_test_does() -> None:
    # The page is read by people and the table by the test; a module moved in one and not
    # the other would teach the wrong rule. ``afmd.x.y`` is written `x/y`, a package with
    # everything below it ``afmd.x.*`` is `x/`.
    rows = _documented_layers()
    assert len(rows) > 10
    wrong: list[str] = []
    for pattern, layer in _layering_table():
        name = pattern.removeprefix("afmd.") if pattern != "afmd" else "afmd"
        name = name[:-2].replace(".", "/") + "/" if name.endswith(".*") else name.replace(".", "/")
        if f"`{name}`" not in rows.get(float(layer), ""):
            wrong.append(f"{pattern} (layer {layer}) is not `{name}` in the row of layer {layer}")
    assert not wrong, "\n".join(wrong)


#: A path of the tree named in code: a tracked top folder, at a word's start (not
#: ``etc/"afmd/config.toml"``, a path on the user's machine).
_TREE_PATH = re.compile(r"(?<![\w./\"-])((?:afmd|tests|bench)/[\w./{},*-]*[\w/}*])")
#: A dotted afmd name: the package, then at least a module.
_AFMD_NAME = re.compile(r"(?<![\w./-])(afmd(?:\.[A-Za-z_]\w*)+)")


def _resolves(dotted: str) -> bool:
    """Whether ``afmd.a.b.c`` is a module, or an attribute path under the longest module
    prefix that imports."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        try:
            for attr in parts[end:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def stale_code_references(page: Path, root: Path = ROOT) -> list[str]:
    """The paths and afmd names in a page's code spans that no longer exist. A name whose
    second part is not one of afmd's modules (``afmd.toml``, ``afmd.rb``) is a file name, not
    a reference; a path with a wildcard or braces is a pattern."""
    modules = {p.stem for p in (root / "afmd").iterdir() if p.suffix == ".py" or p.is_dir()}
    stale: list[str] = []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        for span in re.findall(r"`([^`\n]+)`", line):
            for path in _TREE_PATH.findall(span):
                if not any(c in path for c in "*{}") and not (root / path).exists():
                    stale.append(f"{number}: {path}: no such file")
            for name in _AFMD_NAME.findall(span):
                if name.split(".")[1] in modules and not _resolves(name):
                    stale.append(f"{number}: {name}: no such name")
    return stale


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_name_in_code_exists(page: Path) -> None:
    stale = stale_code_references(page)
    assert not stale, f"{page.relative_to(ROOT)}:\n" + "\n".join(stale)


def test_a_stale_code_reference_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "`afmd/engine/batch/backend.py` and `afmd.service.output_plan.model_formats` stand;\n"
        "`afmd/engine/gone.py`, `tests/smoke.py` and `afmd.service.turn.model_formats` do not,\n"
        "nor `afmd.service.output_plan.nothing`; `afmd.toml`, `etc/\"afmd/config.toml\"`\n"
        "and `tests/**/test_*.py` or `bench/r/{a,b}.{json,md}` are not references.\n"
    )
    assert stale_code_references(page) == [
        "2: afmd/engine/gone.py: no such file",
        "2: tests/smoke.py: no such file",
        "2: afmd.service.turn.model_formats: no such name",
        "3: afmd.service.output_plan.nothing: no such name",
    ]
