"""The docs site's hooks (``mkdocs.yml``): README.md is its home page, links beyond docs/ are checked, and every
object of the API reference has a docstring.

The pages link to repository files as GitHub shows them: ``../bench/results/README.md#on-a-gpu`` from a page of
docs/, ``docs/clusters.md`` from README.md. mkdocs knows only docs/ (and warns, so fails ``--strict``, on a link
beyond it), so each link is resolved here from the file it is written in:

- into docs/: made relative to where the page sits in the site (README.md is served as ``index.md``);
- beyond docs/: the file must exist in the repository, and a ``#fragment`` of a Markdown file must be one of its
  headings as GitHub makes their anchors, else a warning; an image is copied into the site (under ``_repo/``), any
  other file becomes a link to the repository (``repo_url`` in mkdocs.yml) or, without one, its path as code.

A ``::: name`` block (mkdocstrings) whose object, or one of its public members, has no docstring is a warning too.
Every warning fails ``mkdocs build --strict`` (``tests/test_docs.py``).
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.plug_asgd")  # under "mkdocs": strict mode counts its warnings

REPO = Path(__file__).resolve().parent.parent
HOME = REPO / "README.md"
SITE_COPIES = "_repo"  # where the images beyond docs/ land in the site

# fenced code blocks (indented too, as in a list) and inline code: no link is read inside them
FENCE = r"^[ \t]*(`{3,}|~{3,})[^\n]*\n.*?^[ \t]*\1[ \t]*$"
CODE = re.compile(FENCE + r"|`[^`\n]+`", re.M | re.S)
LINK = re.compile(r"(!?)\[((?:[^\[\]\n]|\[[^\]\n]*\])*)\]\(<?([^)\s>]+)>?((?:\s+\"[^\"]*\")?)\)")
DIRECTIVE = re.compile(r"^:::[ \t]+(\S+)", re.M)


def _links(text: str, edit: Any) -> str:
    """``text`` with each link outside code (a link's words may hold code) replaced by ``edit(match)``."""
    code = [m.span() for m in CODE.finditer(text)]

    def each(m: re.Match[str]) -> str:
        return m.group(0) if any(a <= m.start() < b for a, b in code) else edit(m)

    return LINK.sub(each, text)


def github_anchor(title: str) -> str:
    """The anchor GitHub gives a heading: its text (a link's words, no code marks) lowercased, punctuation
    dropped, spaces made hyphens.

    Args:
        title: the heading's text after its ``#`` marks.
    """
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
    title = re.sub(r"<[^>]+>", "", title).strip().lower()
    return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub numbers repeated ones (``name``, ``name-1``...).

    Args:
        path: the Markdown file.
    """
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(FENCE, "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, re.M):
        slug = github_anchor(m.group(1))
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def _target(url: str, written_in: Path) -> tuple[Path, str] | None:
    """The file a relative link points at, and its fragment; None for a URL, an absolute path or ``#...``."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url) or url.startswith(("#", "/")):
        return None
    path, _, fragment = url.partition("#")
    return Path(os.path.normpath(written_in.parent / unquote(path))), fragment


def _images_beyond_docs(text: str, written_in: Path, docs: Path) -> list[Path]:
    found: list[Path] = []

    def collect(m: re.Match[str]) -> str:
        target = _target(m.group(3), written_in) if m.group(1) else None
        if target and not target[0].is_relative_to(docs) and target[0].is_file():
            found.append(target[0])
        return m.group(0)

    _links(text, collect)
    return found


def on_files(files: Files, config: Any) -> Files:
    """README.md as the home page (unless docs/ has an index.md), and the images that pages show from beyond
    docs/ as files of the site.

    Args:
        files: the site's files, docs/'s.
        config: the site's configuration.
    """
    docs = Path(config.docs_dir).resolve()
    if files.get_file_from_path("index.md") is None:
        files.append(File.generated(config, "index.md", abs_src_path=str(HOME)))
    for page in list(files.documentation_pages()):
        source = Path(page.abs_src_path)
        for image in _images_beyond_docs(source.read_text(encoding="utf-8"), source, docs):
            uri = f"{SITE_COPIES}/{image.relative_to(REPO).as_posix()}"
            if files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(image)))
    return files


def _rewrite(m: re.Match[str], page: Any, config: Any) -> str:
    bang, text, url, title = m.groups()
    written_in = Path(page.file.abs_src_path)
    target = _target(url, written_in)
    if target is None:
        return m.group(0)
    path, fragment = target
    docs = Path(config.docs_dir).resolve()
    here = posixpath.dirname(page.file.src_uri)
    suffix = f"#{fragment}" if fragment else ""
    if path.is_relative_to(docs):  # mkdocs checks it, once it is relative to the page's place in the site
        uri = path.relative_to(docs).as_posix()
        return f"{bang}[{text}]({posixpath.relpath(uri, here or '.')}{suffix}{title})"
    where = f"{page.file.src_uri} ({os.path.relpath(written_in, REPO)})"
    if not path.is_relative_to(REPO) or not path.exists():
        log.warning("%s links to %s, which is not a file of the repository", where, url)
        return m.group(0)
    rel = path.relative_to(REPO).as_posix()
    if fragment and path.suffix == ".md" and fragment not in anchors(path):
        log.warning("%s links to %s, but %s has no heading with the anchor #%s", where, url, rel, fragment)
    if bang:
        return f"{bang}[{text}]({posixpath.relpath(f'{SITE_COPIES}/{rel}', here or '.')}{title})"
    if config.repo_url:
        kind = "tree" if path.is_dir() else "blob"
        return f"[{text}]({config.repo_url.rstrip('/')}/{kind}/HEAD/{rel}{suffix})"
    shown = f"`{rel}{suffix}`"
    return shown if text.strip("`") in (rel, rel + suffix, url) else f"{text} ({shown})"


def _undocumented(obj: Any) -> list[str]:
    """``obj`` and its own public functions and classes (members) that have no docstring; an ``@override``
    takes its base's."""
    if obj.is_alias:
        obj = obj.final_target
    missing = [] if obj.docstring else [obj.path]
    if obj.is_class or obj.is_module:
        for name, member in obj.members.items():
            if name.startswith("_") or member.is_alias or not (member.is_function or member.is_class):
                continue
            if any("override" in str(d.value) for d in getattr(member, "decorators", [])):
                continue
            missing += _undocumented(member)
    return missing


_PACKAGES: dict[str, Any] = {}


def _check_docstrings(markdown: str, page: Any) -> None:
    import griffe

    for name in DIRECTIVE.findall(markdown):
        top = name.split(".")[0]
        if top not in _PACKAGES:
            _PACKAGES[top] = griffe.load(top, search_paths=[str(REPO)], docstring_parser="google")
        try:
            obj = _PACKAGES[top][name.partition(".")[2]] if "." in name else _PACKAGES[top]
        except KeyError:
            log.warning("%s documents %s, which does not exist", page.file.src_uri, name)
            continue
        for path in _undocumented(obj):
            log.warning("%s documents %s, which has no docstring", page.file.src_uri, path)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Each relative link resolved from the file it is written in (see the module's docstring), and the
    objects of the page's ``:::`` blocks checked for docstrings.

    Args:
        markdown: the page's source.
        page: the page.
        config: the site's configuration.
        files: the site's files.
    """
    _check_docstrings(markdown, page)
    return _links(markdown, lambda m: _rewrite(m, page, config))
