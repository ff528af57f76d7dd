"""Turn a GGUF file into an ordinary HF model folder (config.json + safetensors + tokenizer).

transformers can read GGUF files (dequantising the weights), but the model it returns is marked
quantized and refuses ``save_pretrained``. We copy its state dict into a fresh model built from
the same config, without the quantization config, check that both give the same logits, and save
that: the folder then opens in transformers and vLLM like any other checkpoint.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from pathlib import Path

import torch

from distill.errors import DistillUserError
from distill.files import atomic_dir, current_umask

log = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")
# Largest relative logit difference between the GGUF model and its float32 copy: the weights are
# copied exactly, so only kernel-level reordering remains.
_CHECK_RTOL = 1e-5


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write an HF folder for ``gguf_path`` at ``out_dir`` (atomically: temp folder, then rename;
    every file readable as the umask allows, like any file the user writes).

    dtype: "float32" keeps the dequantised weights exactly; "bfloat16" halves the folder.
    Raises DistillUserError for a missing file, one that is not GGUF or is cut short (see
    ``check_gguf_file``), bad dtype or an ``out_dir`` that is a file,
    FileExistsError when ``out_dir`` already holds files (also when another process finishes the
    same import first).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if not gguf_path.is_file():
        raise DistillUserError(f"GGUF file not found: {gguf_path}")
    check_gguf_file(gguf_path)
    if dtype not in _DTYPES:
        raise DistillUserError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if out_dir.exists() and not out_dir.is_dir():
        raise DistillUserError(f"{out_dir} is an existing file; give a folder to create for the HF model")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty; choose another output folder or delete it")

    start = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # Tied lm-head weights may be listed as missing; anything else means the copy is wrong.
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF import: state dict mismatch, missing={missing[:5]} unexpected={unexpected[:5]}")
    _check_same_logits(quantized, model)
    del quantized
    model = model.to(getattr(torch, dtype))  # check in float32 first: a cast is a known rounding
    model.config.dtype = dtype

    write_hf_folder(model, tokenizer, out_dir, source=f"imported from {gguf_path.name} by distill import-gguf")
    log.info("imported %s -> %s in %.1f s", gguf_path.name, out_dir, time.perf_counter() - start)
    return out_dir


_GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: Path) -> None:
    """Refuse, as a DistillUserError naming the file, one that is not GGUF or does not hold what
    its header promises: a download cut short or a damaged copy. transformers' reader would fail
    deep inside with a ValueError or struct.error; gguf's GGUFReader maps the file and reads the
    header, every metadata field and the tensor table without copying tensor data, and the last
    tensor must end inside the file."""
    from gguf import GGUFReader

    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise DistillUserError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); give a "
                               ".gguf model file")
    truncated = (f"{path} is a truncated or damaged GGUF file ({size:,} bytes: its header, tensor table or tensor "
                 "data is cut short); download or copy it again")
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, struct.error) as e:  # what gguf raises on a file that ends early
        if "version" in str(e):  # "Sorry, file appears to be version N which we cannot handle"
            raise DistillUserError(f"{path} is of a GGUF version the installed gguf package cannot read; upgrade "
                                   "it (pip install -U gguf)") from None
        raise DistillUserError(truncated) from None
    if max((t.data_offset + t.n_bytes for t in reader.tensors), default=0) > size:
        raise DistillUserError(truncated)


def write_hf_folder(model, tokenizer, out_dir: Path, source: str) -> None:
    """Save ``model`` and ``tokenizer`` as the HF folder ``out_dir`` (a temp folder, then a rename),
    with a SOURCE note; every file gets the mode the umask gives a new file, as everything else
    distill writes, so a teacher shared between users stays readable by them."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(source + "\n")
        mode = 0o666 & ~current_umask()
        for p in tmp.iterdir():  # save_pretrained writes the weights through a 0600 temp file
            if p.is_file():
                os.chmod(p, mode)
        if out_dir.is_dir() and any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} was filled by another process during the import")


def _check_same_logits(reference, copy) -> None:
    """The copy must reproduce the GGUF model's logits on a short input (catches a lost buffer or
    config field, e.g. RoPE scaling, that the state dict does not carry)."""
    vocab = reference.config.vocab_size
    ids = (torch.arange(12) * 7919 % vocab)[None]
    with torch.inference_mode():
        ref = reference(input_ids=ids).logits.float()
        got = copy(input_ids=ids).logits.float()
    err = float((ref - got).abs().max() / ref.abs().max().clamp_min(1.0))
    if not err <= _CHECK_RTOL:
        raise RuntimeError(f"GGUF import: the copied model's logits differ from the GGUF model's (relative {err:.3g})")
