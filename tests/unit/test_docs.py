"""The manual: README.md is one screen over the MkDocs site in docs/, which builds
with --strict (a broken link, a missing anchor or a page outside the nav fails)."""
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build_site(config_file, site_dir, monkeypatch):
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")   # mkdocs-material's banner, printed on every build
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    build(load_config(config_file=str(config_file), site_dir=str(site_dir), strict=True))


def test_the_docs_site_builds_strict_with_every_page_in_its_nav(tmp_path, monkeypatch):
    build_site(ROOT / "mkdocs.yml", tmp_path / "site", monkeypatch)
    import yaml
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = {page for entry in nav for page in entry.values()}
    assert pages == {p.name for p in (ROOT / "docs").glob("*.md")}
    for page in pages:
        assert (tmp_path / "site" / ("" if page == "index.md" else page[:-3]) / "index.html").is_file()


@pytest.mark.parametrize("damage", ["anchor", "page"])
def test_a_broken_link_in_the_docs_fails_the_build(tmp_path, monkeypatch, damage):
    from mkdocs.exceptions import Abort
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "faults.md"
    text = page.read_text()
    link = "sharded.md#a-rank-lost"
    assert link in text
    page.write_text(text.replace(link, "sharded.md#no-such-part" if damage == "anchor" else "no-such-page.md"))
    with pytest.raises(Abort):
        build_site(tmp_path / "mkdocs.yml", tmp_path / "site", monkeypatch)


def test_the_readme_is_one_screen_over_the_docs_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    targets = re.findall(r"\]\(((?:docs|examples)/[^)#]+)(?:#[^)]*)?\)", readme)
    assert len(targets) >= 10
    for target in targets:
        assert (ROOT / target).exists(), target
    linked = {Path(t).name for t in targets if t.startswith("docs/")}
    assert linked == {p.name for p in (ROOT / "docs").glob("*.md")}   # every page is reachable from the README
