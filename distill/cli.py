"""The `distill` command. Thin: each command parses, builds a config, calls one library function."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from teacher_cache.errors import DistillUserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Offline knowledge distillation: cache a teacher's top-k once, train students against it.",
)


@app.command("cache-teacher")
def cache_teacher(
    out: Path = typer.Option(Path("caches/default"), "--out", "-o", help="Cache directory to write (resumed if interrupted)."),
    model: Optional[Path] = typer.Option(None, help="Teacher HF folder; default: the embedded SmolLM2-135M-Instruct."),
    backend: str = typer.Option("hf", help="hf (transformers, CPU or GPU) or vllm."),
    dtype: str = typer.Option("auto", help="Teacher dtype: auto (bfloat16 on a GPU, float32 on a CPU), bfloat16, float16, float32."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N (hf backend)."),
    compile: bool = typer.Option(False, "--compile", help="torch.compile the teacher body (hf; pays off on long GPU runs)."),
    corpus: Optional[list[Path]] = typer.Option(None, help="Files or folders of text (repeatable); default: the Python standard library."),
    corpus_format: str = typer.Option("auto", "--format", help="auto, text, json, jsonl, parquet, arrow or hf-dataset."),
    text_field: str = typer.Option("text", help="Column holding the text (json, parquet, arrow, hf-dataset)."),
    glob: str = typer.Option("*.py", help="Which files of a folder to read as text."),
    seq_len: int = typer.Option(1024, help="Tokens per packed sequence (>= 2)."),
    max_sequences: Optional[int] = typer.Option(None, help="Stop after this many sequences (default: the whole corpus)."),
    k: int = typer.Option(100, "-k", "--k", help="Top-k entries cached per position."),
    codec: str = typer.Option("sqrt8", help="Value codec: fp32, bf16, fp16 or sqrt8 (compressed)."),
    storage: str = typer.Option("parquet", help="parquet or zarr (Zarr v3)."),
    shard_size: int = typer.Option(64, help="Sequences per shard."),
    batch_size: int = typer.Option(8, help="Sequences per teacher call."),
    temperature: float = typer.Option(1.0, help="Cache temperature: stored log-probs are log_softmax(logits / T)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
) -> None:
    """Run a teacher once over a corpus and write its top-k next-token log-probs to a cache.

    Examples:

      distill cache-teacher --max-sequences 64 --seq-len 512 --out caches/stdlib

      distill cache-teacher --model ./Qwen2.5-0.5B --corpus data/ --glob '*.jsonl' --format jsonl -k 64

      distill cache-teacher --backend vllm --max-sequences 16 --out caches/vllm

    Re-running the same command after an interruption resumes where it stopped.
    """
    from pipelines.corpus import CorpusConfig
    from pipelines.stage_one import StageOneConfig, TeacherConfig, cache_teacher as run
    from teacher_cache.build import CacheConfig

    corpus_kwargs = {} if not corpus else {"paths": [str(p) for p in corpus]}
    config = StageOneConfig(
        teacher=TeacherConfig(model=model, backend=backend, dtype=dtype, device=device, compile=compile),
        corpus=CorpusConfig(
            **corpus_kwargs, format=corpus_format, text_field=text_field, file_glob=glob,
            seq_len=seq_len, max_sequences=max_sequences,
        ),
        cache=CacheConfig(
            out=out, k=k, value_codec=codec, storage=storage, shard_size=shard_size,
            batch_size=batch_size, temperature=temperature,
        ),
    )
    report = run(config, progress=not quiet)
    if report.already_complete:
        typer.echo(f"{out}: cache {report.cache_id} is already complete; nothing to do")
        return
    typer.echo(
        f"{out}: cache {report.cache_id} complete; scored {report.tokens_scored:,} tokens in "
        f"{report.wall_seconds:.1f} s ({report.tokens_per_second:,.0f} tok/s; teacher {report.teacher_seconds:.1f} s, "
        f"writer {report.writer_seconds:.1f} s in the background, {report.resumed_shards} shards resumed)"
    )


@app.command("cache-stats")
def cache_stats(
    cache: Path = typer.Argument(..., help="Cache directory."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    plot: Optional[Path] = typer.Option(None, help="Also write a PNG of the distributions (needs matplotlib)."),
) -> None:
    """Inspect a cache: size, compression, teacher perplexity, top-k mass, entropy, rank histogram.

    Examples:

      distill cache-stats caches/default

      distill cache-stats caches/default --json > stats.json

      distill cache-stats caches/default --plot stats.png
    """
    from teacher_cache import stats as cache_stats_lib

    stats = cache_stats_lib.cache_stats(cache)
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
    else:
        typer.echo(cache_stats_lib.render_table(stats))
    if plot is not None:
        cache_stats_lib.plot(stats, plot)
        typer.echo(f"wrote {plot}", err=True)


@app.command("verify")
def verify(cache: Path = typer.Argument(..., help="Cache directory.")) -> None:
    """Check every shard's checksum and the manifest's totals; name the first bad shard.

    Example:

      distill verify caches/default
    """
    from teacher_cache.verify import verify_cache

    report = verify_cache(cache)
    if not report.ok:
        raise DistillUserError(report.message)
    typer.echo(report.message)


@app.command("import-gguf")
def import_gguf(
    gguf: Path = typer.Argument(..., help="GGUF file."),
    out: Path = typer.Argument(..., help="HF folder to create."),
    dtype: str = typer.Option("float32", help="float32 (exact dequantised weights), bfloat16 or float16."),
) -> None:
    """Turn a GGUF file into an HF folder (config.json, safetensors, tokenizer) for any backend.

    Example:

      distill import-gguf SmolLM2-135M-Instruct.Q4_1.gguf teachers/smollm2
    """
    from teacher_cache.gguf_import import import_gguf as run

    typer.echo(run(gguf, out, dtype=dtype))


_USER_ERRORS = (DistillUserError, FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def main() -> None:
    """Entry point: user mistakes print one line and exit 2; an interrupt says how to resume."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "urllib3", "datasets", "transformers", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        app()
    except _USER_ERRORS as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except ImportError as e:
        if "pip install" not in str(e):  # a missing optional extra says what to install; else a bug
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted; run the same command again to resume", err=True)
        sys.exit(130)
