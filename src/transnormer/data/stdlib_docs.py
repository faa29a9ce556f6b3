"""The embedded default corpus: English docstrings of the running Python's standard library.

It exists so that every part of the project (tokenizer training, LM training, tests, examples) works offline
with no download. About 1.5-2 MB of technical English prose, one document per module.

Extraction rule (deterministic for a given stdlib):

* walk ``sysconfig.get_paths()["stdlib"]`` in sorted order, ``.py`` files only, skipping test suites,
  IDLE, ``lib2to3`` (its fixtures are Python 2), ``site-packages`` and the like (:data:`SKIP_DIRS`);
* parse each file with :mod:`ast` (files that do not parse are skipped) and take the module, class and
  function docstrings in source order (``ast.get_docstring`` dedents them like ``inspect.cleandoc``);
* drop docstrings that look like garbage or not English (:func:`looks_like_english_prose`) and exact
  duplicates of an earlier docstring (so that the same text cannot land in two splits);
* a module's kept docstrings, joined by blank lines, form one document keyed by the dotted module name.
"""

from __future__ import annotations

import ast
import os
import re
import sysconfig
import warnings
from pathlib import Path

__all__ = ["SKIP_DIRS", "extract_stdlib_documents", "looks_like_english_prose", "stdlib_root"]

# Directory names never descended into. Test suites are mostly code and fixture strings; lib2to3's
# fixtures are Python 2; idlelib/turtledemo are applications rather than library prose.
SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "idle_test",
        "lib2to3",
        "turtledemo",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "__phello__",
        "ensurepip",
    }
)
# Files whose docstrings are deliberately not prose (``__hello__`` holds single Unicode symbols).
SKIP_FILES = frozenset({"__hello__.py", "this.py"})

# A few very frequent English function words: a docstring of some length that contains (almost) none of
# them is a table, a doctest-only block, or not English.
_FUNCTION_WORDS = frozenset(
    "a an the of to in on for and or not is are be if it this that with as by from return returns "
    "when which can will should may no any all each".split()
)
_WORD = re.compile(r"[A-Za-z]+")
_NOT_ASCII_LETTER = re.compile(r"[^A-Za-z]+")


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def looks_like_english_prose(text: str) -> bool:
    """Heuristic filter for docstrings worth keeping as English text.

    Keeps ``text`` when it has at least 3 words, at most 5 % non-ASCII characters, at least half of its
    non-space characters are ASCII letters, and (for 8+ words) at least 5 % of its words are common
    English function words.
    """
    words = text.split()
    if len(words) < 3 or len(text) < 15:
        return False
    # counted by str methods and a regex, not per character in Python (the extraction's hot spot):
    # str.split() splits at exactly the characters str.isspace() calls space, and the ASCII
    # letters are [A-Za-z]
    non_space = "".join(words)
    non_ascii = len(text) - len(text.encode("ascii", "ignore"))
    if non_ascii > 0.05 * len(text):
        return False
    letters = len(_NOT_ASCII_LETTER.sub("", non_space))
    if letters < 0.5 * len(non_space):
        return False
    if len(words) >= 8:
        tokens = [w.lower() for w in _WORD.findall(text)]
        common = sum(t in _FUNCTION_WORDS for t in tokens)
        if common < 0.05 * max(1, len(tokens)):
            return False
    return True


def _clean(doc: str) -> str:
    # get_docstring already dedented; strip trailing spaces and squeeze runs of blank lines so that a
    # docstring never contains a "document break" of several empty lines.
    lines = [line.rstrip() for line in doc.strip().splitlines()]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text)


def _docstrings(tree: ast.Module) -> list[str]:
    """Module/class/function docstrings in source order (depth first)."""
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
        if doc:
            out.append(doc)
        for child in getattr(node, "body", ()):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)
            elif isinstance(child, (ast.If, ast.Try)):
                # e.g. ``if sys.platform == ...: def f(): ...`` or ``try: ... except ImportError: def f()``
                for block in (child.body, getattr(child, "orelse", ()), getattr(child, "finalbody", ())):
                    for sub in block:
                        if isinstance(sub, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                            visit(sub)

    visit(tree)
    return out


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def _python_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending; sorting makes the walk order deterministic.
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py") and name not in SKIP_FILES and not name.startswith("test_"):
                files.append(Path(dirpath) / name)
    return sorted(files)


def extract_stdlib_documents(root: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """Extract ``(module_name, text)`` documents from the standard library at ``root``.

    Args:
        root: stdlib directory; default :func:`stdlib_root`.

    Returns:
        Documents in sorted-path order; each ``text`` is the module's kept docstrings joined by ``"\\n\\n"``.
    """
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"root: stdlib directory {str(root)!r} does not exist")
    seen: set[str] = set()
    documents: list[tuple[str, str]] = []
    for path in _python_files(root):
        try:
            source = path.read_bytes()
            with warnings.catch_warnings():
                # Some stdlib modules contain invalid escape sequences in docstrings (DeprecationWarning /
                # SyntaxWarning at parse time); they are harmless here.
                warnings.simplefilter("ignore")
                tree = ast.parse(source, filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue
        kept: list[str] = []
        for doc in _docstrings(tree):
            text = _clean(doc)
            if text in seen or not looks_like_english_prose(text):
                continue
            seen.add(text)
            kept.append(text)
        if kept:
            documents.append((_module_name(root, path), "\n\n".join(kept)))
    return documents
