"""Rows of a data set, read through Hugging Face `datasets`: local JSONL / JSON / parquet files and hub names.

`load_rows(spec)` reads what `DataSpec.path` names:
- a local file, or a glob of them: each file is one `load_dataset("json" | "parquet", data_files=file)`;
- a local folder, or a hub data set in the hub cache (a `hf download --repo-type dataset` snapshot under
  `HF_HOME/hub`): `datasets` finds its subsets and splits from the file names (or its README's `configs`),
  then each file of the split is read as above;
- any other hub name: `load_dataset(name, subset, split=...)`, which uses what `datasets` cached under
  `HF_DATASETS_CACHE` and, unless `HF_HUB_OFFLINE=1`, downloads it.
A path that names nothing, or a file `datasets` cannot read, is a ValueError naming it; a hub name found
nowhere is a ValueError naming the folders it looked in and how to fix it.

Each row becomes a `Row` (question, answer text, extras) or is skipped: a missing field, a question that is not
a non-empty string, an answer that is not a string or a finite number (or has no final number, for the gsm8k
format). Skipped rows are counted, and logged once per file with the first one's row number (rows count from
1, as the lines of a JSONL file; blank lines are not rows). A JSON column that mixes strings and numbers is stored
by `datasets` as JSON text: a string there that reads as a number ("7") comes back as that number, and its
floats keep 10 significant digits. `datasets` is imported only when rows are read.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcommon.config.task import QUESTION_FIELDS, DataSpec
from rlcommon.task.rewards import parse_last_number

__all__ = ["DATA_SUFFIXES", "LoadedRows", "Row", "data_fingerprint", "extract_final_answer", "load_rows"]

logger = logging.getLogger(__name__)

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Local file suffix -> the `datasets` builder that reads it."""
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class Row:
    """One usable row: the question (stripped), the reference answer as text, the extras, where it is."""

    question: str
    answer: str
    extras: dict[str, str] = field(default_factory=dict, hash=False)
    where: str = ""
    """"file:row" (rows count from 1), or "name[split]:row" for a data set read whole."""


@dataclass
class LoadedRows:
    rows: list[Row]
    num_malformed: int
    question_field: str
    """The question column used (`DataSpec.question_field`, or the first of QUESTION_FIELDS found)."""


# ------------------------------------------------------------------------------------------------- answers


def _format_number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def extract_final_answer(answer: str) -> str:
    """The numeric final answer of a GSM8K answer ("... #### 1,234" -> "1234"), or of a plain number.

    Raises ValueError if no number can be found.
    """
    text = answer.rsplit("####", 1)[1] if "####" in answer else answer
    value = parse_last_number(text)
    if value is None:
        raise ValueError(f"no numeric final answer in {answer[-80:]!r}")
    return _format_number(value)


def _answer_text(value: Any, spec: DataSpec) -> str:
    """The reference answer of a row's answer value; ValueError with the reason when it is unusable."""
    name = spec.answer_field
    if value is None:
        raise ValueError(f"missing field {name!r}")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{name!r} must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name!r} must be finite")
    text = value.strip() if isinstance(value, str) else str(value) if isinstance(value, int) else _format_number(value)
    if not text:
        raise ValueError(f"{name!r} is empty")
    return extract_final_answer(text) if spec.answer_format == "gsm8k" else text


def _row(record: dict[str, Any], spec: DataSpec, question_field: str, where: str) -> Row:
    """The Row of one record; ValueError with the reason when it is malformed."""
    question = record.get(question_field)
    if question is None:
        raise ValueError(f"missing field {question_field!r}")
    if not isinstance(question, str):
        raise ValueError(f"{question_field!r} must be a string, got {type(question).__name__}")
    if not question.strip():
        raise ValueError(f"{question_field!r} is empty")
    answer = _answer_text(record.get(spec.answer_field), spec)
    extras = {}
    for name in spec.extra_fields:
        value = record.get(name)
        if value is None:
            raise ValueError(f"missing field {name!r}")
        extras[name] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return Row(question=question.strip(), answer=answer, extras=extras, where=where)


# ---------------------------------------------------------------------------------------------- locating


def _is_hub_name(path: str) -> bool:
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or "\\" in path
    return not looks_local and Path(path).suffix not in DATA_SUFFIXES and bool(_HUB_NAME.match(path))


def _local_files(spec: DataSpec, what: str) -> list[Path] | None:
    """The files of a local file or glob (None: the path is a folder or a hub name). ValueError when a local
    path names nothing, or a file is not JSONL / JSON / parquet."""
    path = spec.path
    expanded = os.path.expanduser(path)
    if Path(expanded).is_dir():
        return None
    if glob.has_magic(expanded):
        files = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"{what}.path: no file matches {path!r}")
    elif Path(expanded).is_file():
        files = [Path(expanded)]
    elif _is_hub_name(path):
        return None
    else:
        raise ValueError(f"{what}.path: data file {path!r} not found (a JSONL / JSON / parquet file, a folder, a "
                         "glob, or a hub data set name like 'HuggingFaceH4/MATH-500')")
    for file in files:
        if file.suffix not in DATA_SUFFIXES:
            raise ValueError(f"{what}.path: {file} is not a data set file (expected {', '.join(DATA_SUFFIXES)})")
    if spec.split != "train" or spec.subset is not None:
        raise ValueError(f"{what}: local files have one split, 'train', and no subsets (split = {spec.split!r}, "
                         f"subset = {spec.subset!r}); point {what}.path at the file of the split you want")
    return files


def _hub_snapshot(name: str) -> Path | None:
    """The folder of `name`'s snapshot in the hub cache, if one is there (never downloads)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, repo_type="dataset", local_files_only=True))
    except Exception:  # not in the cache (LocalEntryNotFoundError), or an unreadable cache entry
        return None


def _split_files(folder: Path, spec: DataSpec, what: str) -> list[Path]:
    """The files of `spec.split` (of `spec.subset`) in a data set folder, as `datasets` assigns them."""
    from datasets import load_dataset_builder

    try:
        builder = load_dataset_builder(str(folder), name=spec.subset)
    except Exception as err:
        raise ValueError(f"{what}.path: {folder} is not a data set folder ({_reason(err)})") from None
    data_files = builder.config.data_files or {}
    if spec.split not in data_files:
        raise ValueError(f"{what}.split: {spec.path!r} has no split {spec.split!r} (it has {sorted(data_files)})")
    files = [Path(str(f)) for f in data_files[spec.split]]
    for file in files:
        if file.suffix not in DATA_SUFFIXES:
            raise ValueError(f"{what}.path: {file} is not a data set file (expected {', '.join(DATA_SUFFIXES)})")
    return files


def _reason(err: BaseException) -> str:
    """The error on one line; the reader's own when datasets wrapped it (`raise ... from`)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _hub_miss_message(spec: DataSpec, what: str, err: BaseException) -> str:
    from datasets import config as datasets_config
    from huggingface_hub import constants

    home = os.environ.get("HF_HOME")
    repo_folder = "datasets--" + spec.path.replace("/", "--")
    offline = " (HF_HUB_OFFLINE=1: no download)" if constants.HF_HUB_OFFLINE else ""
    return (
        f"{what}.path: hub data set {spec.path!r} (subset {spec.subset!r}, split {spec.split!r}) was found neither "
        f"in the hub cache {Path(constants.HF_HUB_CACHE) / repo_folder} nor in the datasets cache "
        f"{datasets_config.HF_DATASETS_CACHE} (HF_HOME={home or 'not set'}){offline}: {_reason(err)}. To fix: on a "
        f"machine with network run `hf download --repo-type dataset {spec.path}` (or `huggingface-cli download "
        f"--repo-type dataset {spec.path}`) and copy its {repo_folder} folder into {constants.HF_HUB_CACHE}; or "
        f"point {what}.path at local JSONL / parquet files"
    )


# ------------------------------------------------------------------------------------------------ reading


def _read_file(file: Path, what: str) -> Any:
    from datasets import load_dataset

    try:
        return load_dataset(DATA_SUFFIXES[file.suffix], data_files=str(file), split="train")
    except Exception as err:
        raise ValueError(f"{what}.path: {file} is not a data set ({_reason(err)})") from None


def _read_hub(spec: DataSpec, what: str) -> Any:
    from datasets import load_dataset

    try:
        return load_dataset(spec.path, spec.subset, split=spec.split)
    except Exception as err:
        snapshot = _hub_snapshot(spec.path)
        if snapshot is None:
            raise ValueError(_hub_miss_message(spec, what, err)) from None
        return snapshot


def _question_field(spec: DataSpec, columns: Sequence[str], where: str, what: str) -> str:
    if spec.question_field is not None:
        return spec.question_field
    for name in QUESTION_FIELDS:
        if name in columns:
            return name
    raise ValueError(f"{what}.question_field: {where} has none of the columns {list(QUESTION_FIELDS)} "
                     f"(it has {list(columns)}); set {what}.question_field")


def _column_values(dataset: Any, name: str) -> list[Any]:
    """A column's values. A JSON column mixing strings and numbers is a `datasets` `Json` column: its stored
    JSON texts are parsed here, exactly (datasets' own decoding rounds floats)."""
    from datasets import Json

    values = dataset.select_columns([name]).with_format("arrow")[:].column(name).to_pylist()
    if isinstance(dataset.features[name], Json):
        values = [None if v is None else json.loads(v) for v in values]
    return values


def _rows_of(
    dataset: Any, spec: DataSpec, label: str, what: str, question_field: str | None
) -> tuple[list[Row], int, str]:
    """The usable rows of one `datasets.Dataset` read from `label` (a file, or name[split]), the number skipped,
    and the question column; one log line names `label` and its first skipped row."""
    columns = list(dataset.column_names)
    question_field = question_field or _question_field(spec, columns, label, what)
    needed = [c for c in dict.fromkeys([question_field, spec.answer_field, *spec.extra_fields]) if c in columns]
    table = {name: _column_values(dataset, name) for name in needed}
    rows, skipped, first = [], 0, ""
    for index in range(len(dataset)):
        where = f"{label}:{index + 1}"
        try:
            rows.append(_row({c: table[c][index] for c in needed}, spec, question_field, where))
        except ValueError as err:
            skipped += 1
            first = first or f"row {index + 1}: {err}"
    if skipped:
        logger.warning("%s: skipped %d malformed row(s) of %d; the first: %s", label, skipped, len(dataset), first)
    return rows, skipped, question_field


def load_rows(spec: DataSpec, *, what: str = "task.data") -> LoadedRows:
    """The usable rows of `spec` in order, and how many were skipped as malformed (see the module docstring).

    what: the config key of `spec` in messages ("task.data", "task.eval_sets[0]", "task.path"). ValueError when
    the path names nothing readable or no row is usable.
    """
    files = _local_files(spec, what)
    sources: list[tuple[str, Any]] = []
    if files is None:
        local = Path(os.path.expanduser(spec.path))
        folder = local if local.is_dir() else None
        if folder is None:
            read = _read_hub(spec, what)
            if isinstance(read, Path):
                folder = read
            else:
                sources.append((f"{spec.path}[{spec.split}]", read))
        if folder is not None:
            files = _split_files(folder, spec, what)
    for file in files or []:
        sources.append((str(file), _read_file(file, what)))
    rows: list[Row] = []
    num_malformed, question_field = 0, spec.question_field
    for label, dataset in sources:
        found, skipped, question_field = _rows_of(dataset, spec, label, what, question_field)
        rows.extend(found)
        num_malformed += skipped
    if not rows:
        raise ValueError(f"{what}: no usable row in {spec.path!r} ({num_malformed} malformed; see the log line above "
                         f"for the first; columns used: question {question_field!r}, answer {spec.answer_field!r}"
                         f"{', extras ' + str(spec.extra_fields) if spec.extra_fields else ''})")
    return LoadedRows(rows=rows, num_malformed=num_malformed, question_field=question_field or "")


def data_fingerprint(spec: DataSpec) -> dict[str, Any]:
    """What identifies the rows of `spec` without reading them (the model builder's cache key): the sha256 of
    each local file (a folder: every file in it), or the hub name with its cached snapshot's revision."""
    expanded = Path(os.path.expanduser(spec.path))
    if expanded.is_dir():
        files = sorted(p for p in expanded.rglob("*") if p.is_file() and ".cache" not in p.parts)
    elif glob.has_magic(str(expanded)):
        files = sorted(Path(p) for p in glob.glob(str(expanded), recursive=True) if Path(p).is_file())
    elif expanded.is_file():
        files = [expanded]
    else:
        snapshot = _hub_snapshot(spec.path) if _is_hub_name(spec.path) else None
        return {"hub": spec.path, "revision": snapshot.name if snapshot is not None else None}
    return {"files": [[str(f), hashlib.sha256(f.read_bytes()).hexdigest()] for f in files]}
