from typing import Any

from modules.dataLoader.pipeline.PipelineError import PipelineError
from modules.dataLoader.pipeline.SourceModule import SourceModule


class ListSource(SourceModule):
    """The source of a pipeline: a list of records (dicts), item i being record i; produces `names`
    (every record must hold each of them)."""

    def __init__(self, records: list[dict[str, Any]], names: list[str], name: str | None = None):
        super().__init__(name)
        self.records = list(records)
        self.names = list(names)
        for position, record in enumerate(self.records):
            missing = [n for n in self.names if n not in record]
            if missing:
                raise PipelineError(f"module '{self.name}': record {position} lacks {missing} (has {sorted(record)})")

    def produces(self) -> list[str]:
        return list(self.names)

    def length(self) -> int:
        return len(self.records)

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        record = self.records[index]
        return {name: record[name] for name in self.names}
