"""rankwatch.diagnosis.hang: who hung. Pure: the records every rank's background thread ships
while the job does not progress (:mod:`.records`), the rules that turn them into one verdict
(:mod:`.classify`), and the verdict's words (:mod:`.words`)."""

from rankwatch.diagnosis.hang.classify import HangReport, HangVerdict, classify_hang
from rankwatch.diagnosis.hang.records import (
    HANG_CLASSES,
    Collective,
    RankRecord,
    record_from_dict,
)

__all__ = [
    "HANG_CLASSES",
    "Collective",
    "HangReport",
    "HangVerdict",
    "RankRecord",
    "classify_hang",
    "record_from_dict",
]
