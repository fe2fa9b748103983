"""Long documents for streamed perplexity and agreement: text files, Project Gutenberg boilerplate
stripped, cut into token windows.

The tests and benchmarks read the public-domain books of ``shared/data/pg19-sample`` next to the
repository (:func:`default_data_dir`; override with ``$EVICTLAYERS_DATA`` or an explicit directory).
Their text is read at run time and never copied into the repository.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DATA_ENV", "default_data_dir", "document_windows", "read_texts", "strip_gutenberg"]

DATA_ENV = "EVICTLAYERS_DATA"

# new-style header/footer: "*** START OF THIS PROJECT GUTENBERG EBOOK ... ***" / "*** END OF ..."
_START = re.compile(r"^\*{3}\s*START OF (?:THIS|THE) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_END = re.compile(r"^\*{3}\s*END OF (?:THIS|THE) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
# old-style (1990s) header: the licence ends with "*END*THE SMALL PRINT! ..." (or "*END THE SMALL PRINT!")
_SMALL_PRINT_END = re.compile(r"^.*\*END\*?\s*THE SMALL PRINT.*$", re.IGNORECASE | re.MULTILINE)
# old-style footer: "End of the Project Gutenberg Edition of ..." / "End of Project Gutenberg's ..."
_OLD_END = re.compile(r"^\s*End of (?:the )?Project Gutenberg.*$", re.IGNORECASE | re.MULTILINE)
# credit paragraphs right after the header ("Produced by ...", "This etext was prepared by ...")
_CREDIT = re.compile(r"produced by|prepared by|project gutenberg|\betext\b|e-text|distributed proofread", re.IGNORECASE)


def default_data_dir() -> Path:
    """``$EVICTLAYERS_DATA`` if set, else ``<repository>/../shared/data/pg19-sample``."""
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV]).expanduser()
    return Path(__file__).resolve().parents[3].parent / "shared" / "data" / "pg19-sample"


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg file: header, licence, credits and footer removed.

    New-style files keep the text between the ``*** START OF ...`` and ``*** END OF ...`` lines;
    old-style files the text after the ``*END*THE SMALL PRINT!`` line and before ``End of the Project
    Gutenberg ...``. Credit paragraphs right after the header ("Produced by ...") go too. Text without
    any of these markers is returned unchanged (apart from normalised line ends), so any plain text
    file can be used.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _START.search(text)
    small_print = _SMALL_PRINT_END.search(text)
    if start is not None:
        body = text[start.end() :]
        end = _END.search(body)
        body = body[: end.start()] if end is not None else body
    elif small_print is not None:
        body = text[small_print.end() :]
    else:
        return text.strip()
    end = _OLD_END.search(body)
    if end is not None:
        body = body[: end.start()]
    paragraphs = re.split(r"\n\s*\n", body.strip())
    while paragraphs and _CREDIT.search(paragraphs[0]) and len(paragraphs[0]) < 1000:
        paragraphs.pop(0)
    return "\n\n".join(paragraphs).strip()


def read_texts(source: str | os.PathLike | Sequence[str | os.PathLike] | None = None) -> list[tuple[str, str]]:
    """``[(file name, stripped text)]`` from a directory of ``.txt`` files (sorted by name) or a list of files.

    Raises:
        FileNotFoundError: the directory or a file does not exist, or the directory has no ``.txt``
            files; the message says how to point at the data.
    """
    hint = f"set ${DATA_ENV} or pass --data-dir: a directory of plain-text books (*.txt), or pass text files"
    if source is None:
        source = default_data_dir()
    if isinstance(source, (str, os.PathLike)):
        directory = Path(source).expanduser()
        if not directory.exists():
            raise FileNotFoundError(f"document directory {directory} does not exist; {hint}")
        if directory.is_file():
            files = [directory]
        else:
            files = sorted(directory.glob("*.txt"))
            if not files:
                raise FileNotFoundError(f"document directory {directory} has no .txt files; {hint}")
    else:
        files = [Path(f).expanduser() for f in source]
        if not files:
            raise FileNotFoundError(f"no document files given; {hint}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"document file(s) not found: {', '.join(missing)}; {hint}")
    return [(f.name, strip_gutenberg(f.read_text(encoding="utf-8", errors="replace"))) for f in files]


def _paragraph_start(text: str, offset: int) -> int:
    """The first paragraph start at or after ``offset`` (``offset`` itself if there is none)."""
    if offset <= 0:
        return 0
    found = text.find("\n\n", offset)
    return offset if found < 0 else found + 2


def document_windows(
    tokenizer,
    texts: Sequence[tuple[str, str]],
    n_docs: int,
    doc_tokens: int,
    start: float = 0.1,
) -> list[dict]:
    """``n_docs`` windows of exactly ``doc_tokens`` tokens, taken round-robin from ``texts``.

    Document ``i`` comes from text ``i % len(texts)``; the windows of one text are consecutive and
    do not overlap, starting at the first paragraph after ``start`` (a fraction of its characters;
    0.1 skips title pages and tables of contents). Tokenised with ``add_special_tokens=False``.

    Returns:
        ``[{"source": file name, "window": k, "input_ids": [doc_tokens ints]}]`` in document order.

    Raises:
        ValueError: bad sizes, or a text too short for the windows asked of it (with the numbers).
    """
    if n_docs < 1:
        raise ValueError(f"n_docs must be >= 1, got {n_docs}")
    if doc_tokens < 2:
        raise ValueError(f"doc_tokens must be >= 2 (one token to predict), got {doc_tokens}")
    if not 0.0 <= start < 1.0:
        raise ValueError(f"start must be a fraction in [0, 1), got {start}")
    if not texts:
        raise ValueError("no texts to cut documents from")
    per_text = [len(range(i, n_docs, len(texts))) for i in range(len(texts))]
    windows: dict[int, list[list[int]]] = {}
    for i, ((name, text), count) in enumerate(zip(texts, per_text, strict=True)):
        if count == 0:
            continue
        offset = _paragraph_start(text, int(start * len(text)))
        need = count * doc_tokens
        # tokenise a generous slice (~8 characters per token), the whole rest if that falls short
        ids = tokenizer.encode(text[offset : offset + 8 * need + 1000], add_special_tokens=False)
        if len(ids) < need:
            ids = tokenizer.encode(text[offset:], add_special_tokens=False)
        if len(ids) < need:
            raise ValueError(
                f"{name}: {len(ids)} tokens after {start:.0%} of the text, but {count} window(s) of "
                f"{doc_tokens} tokens need {need}; use fewer or shorter documents, or a smaller start"
            )
        windows[i] = [ids[k * doc_tokens : (k + 1) * doc_tokens] for k in range(count)]
    return [
        {"source": texts[i % len(texts)][0], "window": i // len(texts),
         "input_ids": windows[i % len(texts)][i // len(texts)]}
        for i in range(n_docs)
    ]

