"""Text files as their editors wrote them: the byte-order mark, when there is one, says the encoding."""
import codecs
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# longest first: UTF-32 LE's mark begins with UTF-16 LE's
BYTE_ORDER_MARKS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
                    (codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def decode_with_bom(data: bytes, path: str | Path = "") -> str | None:
    """The text after a byte-order mark, decoded as the mark says; None when the data has no mark. Bytes that the
    named encoding cannot read (a truncated file) become U+FFFD, with one warning naming the file."""
    for mark, encoding in BYTE_ORDER_MARKS:
        if data.startswith(mark):
            body = data[len(mark):]
            try:
                return body.decode(encoding)
            except UnicodeDecodeError as error:
                log.warning("%s starts with the %s byte-order mark but byte %d is not %s; unreadable bytes are "
                            "replaced by U+FFFD", path, encoding.upper(), error.start + len(mark), encoding.upper())
                return body.decode(encoding, errors="replace")
    return None


def read_text_file(path: str | Path) -> str:
    """A caption, prompt or manifest file as text. A byte-order mark names the encoding (UTF-8, UTF-16 LE/BE as
    Windows Notepad's "Unicode" and PowerShell 5's `>` write, UTF-32) and is removed; a file without one is UTF-8,
    or else (a Latin-1 `caf\xe9` from an old tool) read as Windows-1252 / Latin-1 with one warning naming it."""
    data = Path(path).read_bytes()
    text = decode_with_bom(data, path)
    if text is not None:
        return text
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        try:
            text = data.decode("cp1252")
        except UnicodeDecodeError:
            text = data.decode("latin-1")
        log.warning("%s is not UTF-8 (byte 0x%02x at offset %d); read as Windows-1252 / Latin-1", path,
                    data[error.start], error.start)
        return text
