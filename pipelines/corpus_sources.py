"""Where a corpus's documents come from: the files a corpus config names, and their documents as
strings, from local files only (never the hub).

Text files are read here, one document a file, with universal newlines (as `open` in text mode
reads them); a file that is not UTF-8 text (it holds a NUL byte, or bytes that are not UTF-8) is
skipped and counted, or refused, as `encoding_errors` says, so a glob that matches binary files
never feeds the teacher garbage. The other formats are read through the `datasets` library in
streaming mode (`load_dataset(..., streaming=True)`) or memory-mapped (`load_from_disk`), so
nothing is cached to disk and nothing is written next to the user's files, and reading stops as
soon as the caller stops asking for documents.

Errors that a setting can fix are `ConfigError`s naming that setting, so the CLI names its option
and a recipe its key.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from distill.configs import ConfigError
from distill.errors import DistillUserError

CorpusFormat = Literal["auto", "text", "json", "jsonl", "parquet", "arrow", "hf-dataset"]
# What to do with a text file that is not UTF-8 text: skip it and count it, refuse it, or decode
# it with the bad bytes replaced (U+FFFD) or dropped. A file holding a NUL byte is binary and is
# never decoded: skipped, or refused under "strict".
EncodingErrors = Literal["skip", "strict", "replace", "ignore"]
_SUFFIX_FORMATS = {".json": "json", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_BUILDERS = {"json": "json", "jsonl": "json", "parquet": "parquet", "arrow": "arrow"}
# load_dataset resolves each data file (a cost per file), so files are handed over in groups and
# a group is only resolved when the reader gets to it: an early stop skips the rest.
_FILES_PER_LOAD = 256
_ROWS_PER_BATCH = 256


@dataclass(frozen=True)
class Source:
    """One thing to read: a list of files of one format, or a folder written by save_to_disk."""

    path: Path  # the path as the user named it (a file or a folder)
    format: str  # resolved: never "auto"
    files: tuple[Path, ...]  # files to read, in order; empty for "hf-dataset"

    def describe(self, file_glob: str) -> str:
        if self.format == "hf-dataset" or self.path.is_file():
            return f"{self.path} ({self.format})"
        return f"{self.path} ({self.format}, {len(self.files)} files matching {file_glob})"


def resolve_sources(
    paths: Sequence[Path], format: str, file_glob: str, exclude_dirs: Sequence[str]
) -> list[Source]:
    """The sources named by ``paths``, in order. Folders are walked recursively and their files
    matching ``file_glob`` are taken sorted by relative path; under ``format="auto"`` a folder
    written by ``save_to_disk`` is a saved dataset, and each file's suffix picks its format
    (.json, .jsonl, .parquet, .arrow; anything else is read as text)."""
    sources: list[Source] = []
    for path in paths:
        check_readable(path)
        if format == "hf-dataset" or (format == "auto" and _is_saved_dataset(path)):
            if not _is_saved_dataset(path):
                raise ConfigError(
                    "format",
                    f"is 'hf-dataset', which needs a folder written by datasets' save_to_disk; "
                    f"{path} has no state.json or dataset_dict.json: pass such a folder or choose "
                    "another format",
                )
            sources.append(Source(path, "hf-dataset", ()))
            continue
        files = [path] if path.is_file() else _walk(path, file_glob, exclude_dirs)
        for file_format, run in _runs_by_format(files, format):
            sources.append(Source(path, file_format, tuple(run)))
    return sources


def iter_documents(
    source: Source,
    text_field: str,
    encoding_errors: str,
    file_glob: str,
    skipped: list[Path] | None = None,
) -> Iterator[str | None]:
    """The documents of ``source`` in order: one per text file, one per row otherwise. A row whose
    ``text_field`` is null yields None. Text files that are not UTF-8 text and are skipped (see
    ``EncodingErrors``) are appended to ``skipped``. Read errors become one-line user errors."""
    errors: tuple[type[BaseException], ...] = (OSError, ValueError, UnicodeError)
    if source.format != "text":  # plain text files are read without datasets and pyarrow
        import datasets.exceptions
        import pyarrow

        errors += (pyarrow.ArrowException, datasets.exceptions.DatasetsError)
    where = source.describe(file_glob)
    try:
        if source.format == "hf-dataset":
            yield from _iter_saved_dataset(source.path, text_field)
            return
        if source.format == "text":
            yield from _iter_text_files(source.files, encoding_errors, skipped)
            return
        for start in range(0, len(source.files), _FILES_PER_LOAD):
            yield from _iter_files(
                source.files[start : start + _FILES_PER_LOAD], source.format, text_field
            )
    except DistillUserError:
        raise
    except errors as e:
        raise ConfigError(
            "format", f"cannot read corpus {where}: {_first_line(e)}; check the file or choose the right format"
        ) from e


def _iter_text_files(
    files: Sequence[Path], encoding_errors: str, skipped: list[Path] | None
) -> Iterator[str]:
    for file in files:
        text = _read_text_file(file, encoding_errors)
        if text is None:
            if skipped is not None:
                skipped.append(file)
            continue
        yield text


def _read_text_file(file: Path, encoding_errors: str) -> str | None:
    """The text of ``file`` with universal newlines ("\\r\\n" and "\\r" become "\\n", as `open`
    in text mode reads it), or None when it is not UTF-8 text and ``encoding_errors`` skips it."""
    data = file.read_bytes()
    if b"\0" in data:
        if encoding_errors == "strict":
            raise _not_utf8(file, "it holds NUL bytes (a binary file)")
        return None
    decode_errors = "strict" if encoding_errors == "skip" else encoding_errors
    try:
        text = data.decode("utf-8", errors=decode_errors)
    except UnicodeDecodeError as e:
        if encoding_errors == "skip":
            return None
        raise _not_utf8(file, str(e)) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _not_utf8(file: Path, problem: str) -> ConfigError:
    return ConfigError(
        "encoding_errors",
        f"is 'strict' and could not read corpus {file} (text): {problem}; narrow the glob to text "
        "files, or skip such files ('skip', the default) or decode them lossily ('replace')",
    )


def _iter_files(files: Sequence[Path], format: str, text_field: str) -> Iterator[str | None]:
    import datasets

    # data_files are glob patterns to datasets: escape them, or a name with "[" matches nothing.
    data_files = [glob.escape(str(f.resolve())) for f in files]
    with _hub_offline():
        dataset = datasets.load_dataset(
            _BUILDERS[format], data_files=data_files, split="train", streaming=True
        )
    columns = list(dataset.features) if dataset.features is not None else None
    for batch in dataset.iter(batch_size=_ROWS_PER_BATCH):
        if columns is None:
            columns = list(batch)
        _check_column(text_field, columns, files[0] if len(files) == 1 else files[0].parent)
        yield from _check_strings(batch[text_field], text_field, files[0])


def _iter_saved_dataset(path: Path, text_field: str) -> Iterator[str | None]:
    import datasets

    with _hub_offline():
        dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        splits = sorted(dataset)
        if len(splits) != 1 and "train" not in dataset:
            raise DistillUserError(
                f"saved dataset {path} has splits {splits} and none is 'train'; pass the folder "
                f"of the one split to use (e.g. {path / splits[0]})"
            )
        dataset = dataset["train"] if "train" in dataset else dataset[splits[0]]
    _check_column(text_field, dataset.column_names, path)
    # select_columns and iter only read the memory-mapped arrow files: no cache file is written.
    for batch in dataset.select_columns([text_field]).iter(batch_size=_ROWS_PER_BATCH):
        yield from _check_strings(batch[text_field], text_field, path)


def _check_column(text_field: str, columns: list[str], where: Path) -> None:
    if text_field not in columns:
        raise ConfigError(
            "text_field",
            f"{text_field!r} is not a column of {where} (columns: {', '.join(columns) or 'none'}); "
            "give the text column",
        )


def _check_strings(values: list, text_field: str, where: Path) -> list[str | None]:
    for value in values:
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                "text_field",
                f"{text_field!r} of {where} holds {type(value).__name__} values, not strings; "
                "give a text column",
            )
    return values


def check_readable(path: Path) -> None:
    """A corpus path exists and can be read (ConfigError naming `paths`)."""
    if not path.exists():
        raise ConfigError("paths", f"names {path}, which does not exist; give an existing file or folder")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise ConfigError("paths", f"names {path}, which is not readable; fix its permissions")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def _walk(folder: Path, file_glob: str, exclude_dirs: Sequence[str]) -> list[Path]:
    def fail(error: OSError) -> None:
        raise DistillUserError(f"cannot list corpus folder {error.filename}: {error.strerror}")

    relative: list[str] = []
    for root, dirs, names in os.walk(folder, onerror=fail):
        dirs[:] = [d for d in dirs if d not in exclude_dirs]
        base = PurePosixPath(Path(root).relative_to(folder).as_posix())
        relative.extend(str(base / n) for n in names if (base / n).match(file_glob))
    if not relative:
        raise ConfigError(
            "file_glob",
            f"{file_glob!r} matches no files under corpus folder {folder}; give a pattern that "
            "does (e.g. '*.txt' or '*.jsonl')",
        )
    return [folder / r for r in sorted(relative)]


def _runs_by_format(files: list[Path], format: str) -> Iterator[tuple[str, list[Path]]]:
    """Consecutive files of one format, grouped, so each group is one load_dataset call."""
    run: list[Path] = []
    run_format = None
    for file in files:
        file_format = format if format != "auto" else _SUFFIX_FORMATS.get(file.suffix, "text")
        if run and file_format != run_format:
            yield run_format, run
            run = []
        run_format = file_format
        run.append(file)
    if run:
        yield run_format, run


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Offline mode for the duration of a load: datasets reads HF_HUB_OFFLINE once at import,
    so the flag it checks is set directly (and restored) rather than through the environment."""
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved
