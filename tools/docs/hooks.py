"""MkDocs hooks (mkdocs.yml ``hooks``): links from docs/ to the rest of the repository.

The pages in docs/ link to files beside them in the repository (``../spec/bsr.pml``,
``../bench/results/*.json``), which resolve where the pages are read in the repository itself
but lie outside the site's ``docs_dir``. Each such file that exists is copied into the site under
``repo/`` and its links are pointed there; a link to a file the repository does not contain is
left as it is, so the strict build fails on it (docs never cite a file the repository lacks).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

#: where the copied repository files go, inside the site
PREFIX = "repo"


class RepoFile(File):
    """A repository file copied as it is (a Markdown one too: not a page of the site)."""

    def is_documentation_page(self) -> bool:
        return False

    def is_static_page(self) -> bool:
        return False


#: a Markdown link or image target (inline form), without its title
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?(?:\s+\"[^\"]*\")?\))")


def _outside(config: MkDocsConfig, page_src: str, target: str) -> str | None:
    """The repository path of ``target`` (a link in the page ``page_src``) when it leaves
    docs_dir and names a file of the repository, else None."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    docs = Path(config.docs_dir).resolve()
    root = Path(config.config_file_path).resolve().parent
    where = (docs / posixpath.dirname(page_src) / target).resolve()
    if where.is_relative_to(docs) or not where.is_relative_to(root) or not where.is_file():
        return None
    return where.relative_to(root).as_posix()


def _repo_links(config: MkDocsConfig, page_src: str, markdown: str) -> tuple[str, set[str]]:
    """``markdown`` with its links to repository files pointed at their copies under PREFIX,
    and those files' repository paths."""
    found: set[str] = set()

    def one(match: re.Match[str]) -> str:
        path = _outside(config, page_src, match.group(2))
        if path is None:
            return match.group(0)
        found.add(path)
        copy = posixpath.relpath(f"{PREFIX}/{path}", posixpath.dirname(page_src) or ".")
        return f"{match.group(1)}{copy}{match.group(3)}"

    return LINK.sub(one, markdown), found


def on_files(files: Files, *, config: MkDocsConfig, **kwargs: Any) -> Files:
    """Add each repository file that a page links to, so the site carries it."""
    root = Path(config.config_file_path).resolve().parent
    wanted: set[str] = set()
    for page in files.documentation_pages():
        _, found = _repo_links(config, page.src_uri, Path(page.abs_src_path or "").read_text())
        wanted |= found
    for path in sorted(wanted):
        copy = RepoFile(
            f"{PREFIX}/{path}",
            src_dir=None,
            dest_dir=config.site_dir,
            use_directory_urls=False,
            inclusion=InclusionLevel.NOT_IN_NAV,
        )
        copy.abs_src_path = str(root / path)
        files.append(copy)
    return files


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, **kwargs: Any) -> str:
    """Point the page's links to repository files at their copies in the site."""
    return _repo_links(config, page.file.src_uri, markdown)[0]
