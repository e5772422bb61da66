"""One line per problem from pydantic's ValidationError, naming the dotted field. Its own module below every config
class, so that a section validating a nested part (the E2V datasets) and config_io use it without importing each
other."""
import re
from typing import Any

from pydantic import ValidationError


def short_repr(value: Any, limit: int = 120) -> str:
    """repr() cut to `limit` characters: a problem line quotes the bad value, not a megabyte of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 15]}... ({len(text)} chars)"


_NAMES_ITS_FIELD = re.compile(r"[A-Za-z_][\w.]*: ")


def format_validation_error(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            problems.append(f"{field}: unknown key (value {short_repr(item['input'])})")
        elif item["type"] == "missing":
            problems.append(f"{field}: required, but missing")
        elif item["type"] == "value_error" and _NAMES_ITS_FIELD.match(message := item["msg"][len("Value error, "):]):
            # a section's own check names the field it is about ("lora.dora: ..."): say it once, from the top
            loc = [str(part) for part in item["loc"]]
            if loc and message.startswith(loc[-1] + "."):
                loc = loc[:-1]
            problems.append(".".join(loc + [message]))
        else:
            message = item["msg"].removeprefix("Value error, ")
            problems.append(f"{field}: {short_repr(item['input'])} is not allowed: {message}")
    return problems
