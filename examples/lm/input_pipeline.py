"""Text for the language model: English prose that ships with Python, or a file the user gives.

Characters are the tokens: any UTF-8 text works, with no tokenizer to download.
"""

import pathlib
from typing import NamedTuple

import numpy as np

BUNDLED = "bundled"


class Text(NamedTuple):
    """A character corpus split into training and validation token arrays.

    Attributes:
      train: int32 token ids.
      valid: int32 token ids (the last 10% of the text).
      vocab: the characters, index = token id.
      source: where the text came from.
    """

    train: np.ndarray
    valid: np.ndarray
    vocab: str
    source: str


def bundled_text() -> tuple[str, str]:
    """English prose that ships with every CPython, and its description.

    ``pydoc_data.topics`` holds the Python language reference's topics
    (``help("FOR")`` and the like): about 465,000 characters of English
    technical prose, in the standard library, so it is there offline.
    """
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return text, "CPython's pydoc_data.topics (the language reference)"


def load(source: str = BUNDLED, limit: int | None = None) -> Text:
    """Reads the corpus.

    Args:
      source: ``"bundled"`` or the path of a UTF-8 text file.
      limit: keep at most this many characters (None: all).

    Returns:
      The :class:`Text`.

    Raises:
      FileNotFoundError: when the file does not exist.
      ValueError: when it is not UTF-8 text or too short to split.
    """
    if source == BUNDLED:
        text, description = bundled_text()
    else:
        path = pathlib.Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"text file {str(path)!r} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{str(path)!r} is not UTF-8 text: {error}") from None
        description = str(path)
    if limit is not None:
        text = text[:limit]
    if len(text) < 1000:
        raise ValueError(f"{description!r} holds {len(text)} characters; at least 1000 are needed")
    vocab = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(vocab)}
    tokens = np.fromiter((lookup[c] for c in text), np.int32, len(text))
    cut = int(0.9 * len(tokens))
    return Text(tokens[:cut], tokens[cut:], vocab, description)
