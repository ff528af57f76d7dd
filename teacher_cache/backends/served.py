"""A served teacher: prompt log-probabilities from a running vLLM server's OpenAI-compatible API
(`--backend vllm --teacher-url URL`), for a teacher that lives on another machine.

One `POST /v1/completions` a sequence, the token ids as the prompt: ``max_tokens=1``,
``prompt_logprobs=k`` (vLLM's extension), ``logprobs=k`` and ``return_tokens_as_token_ids``, as
the offline vllm backend (teacher_cache/backends/vllm.py) asks vLLM in process; prompt position
``t + 1`` is our row ``t``, the generated token's top log-probs the last row. The server must
serve the teacher folder given as ``--model`` (its weights hash and tokenizer identify the cache,
the same as the offline backend's) at temperature 1 with raw log-probabilities (vLLM's default),
and allow ``--max-logprobs`` >= k. Requests go out on a few threads at once (the server batches
them); a request that fails (no answer, a 5xx) is retried with a growing wait, then the build
stops with one line: the shards written so far are kept and a rerun resumes.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from distill.errors import DistillUserError
from teacher_cache.backends.base import canonical_dtype, check_k, check_sequences
from teacher_cache.backends.folder import check_model_dir, weights_hash
from teacher_cache.backends.vllm import dict_entries
from teacher_cache.targets import TeacherTargets, tail_logmass_from_topk

_RETRY_WAITS_S = (1.0, 2.0, 4.0)  # between the attempts of one request


class ServedVLLMBackend:
    """Teacher targets from a vLLM server at `url` serving the HF folder `model_dir`.

    dtype: the dtype the server runs (recorded in the cache's identity as the offline backend's).
    temperature: must be 1.0. concurrency: requests in flight at once. timeout_s: one request's.
    """

    name = "vllm"

    def __init__(self, url: str, model_dir: str | Path, dtype: str = "bfloat16", temperature: float = 1.0,
                 concurrency: int = 8, timeout_s: float = 120.0):
        self.model_dir = check_model_dir(model_dir)
        self.dtype, self.url = canonical_dtype(dtype), url.rstrip("/")
        if temperature != 1.0:
            raise DistillUserError(f"--teacher-url: a served teacher caches at temperature 1.0 only (vLLM's prompt "
                                   f"log-probs ignore temperature), got {temperature}")
        self.concurrency, self.timeout_s = concurrency, timeout_s
        models = self._request("/v1/models", None, what="list its models")["data"]
        served = [m["id"] for m in models]
        self.model = next((m for m in served if Path(m).name == self.model_dir.name or m == str(self.model_dir)),
                          None)
        if self.model is None:
            raise DistillUserError(f"--teacher-url {self.url} serves {served}, not the teacher folder {self.model_dir}; "
                                   "serve that folder, or give --model the folder the server serves")
        self.max_model_len = int(models[served.index(self.model)].get("max_model_len") or 1 << 30)
        config = json.loads((self.model_dir / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self._weights_hash: str | None = None

    def describe(self) -> dict:
        if self._weights_hash is None:
            self._weights_hash = weights_hash(self.model_dir)
        return {"path": str(self.model_dir), "weights_hash": self._weights_hash, "backend": "vllm", "dtype": self.dtype}

    def score(self, sequences: list[np.ndarray], k: int) -> list[TeacherTargets]:
        """sequences: int [L_i] token ids each (2 <= L_i < the server's max_model_len); L_i rows each."""
        seqs = check_sequences(sequences, self.vocab_size, self.max_model_len - 1,
                               " (the server's max_model_len - 1); serve with a larger --max-model-len")
        check_k(k, self.vocab_size)
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(lambda seq: self._score_one(seq, k), seqs))

    def close(self) -> None:
        pass

    def _score_one(self, seq: np.ndarray, k: int) -> TeacherTargets:
        body = {"model": self.model, "prompt": seq.tolist(), "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": k, "logprobs": k, "return_tokens_as_token_ids": True}
        choice = self._request("/v1/completions", body, what="score a sequence")["choices"][0]
        return _targets(choice, seq, k, self.url)

    def _request(self, path: str, body: dict | None, what: str) -> dict:
        """The JSON answer of one request, retried after a failure (module doc)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        problem = ""
        for wait in (*_RETRY_WAITS_S, None):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                    return json.loads(answer.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:200]
                if e.code < 500:  # the server understood and refused: retrying will not help
                    raise DistillUserError(f"--teacher-url {self.url} refused to {what} (HTTP {e.code}: {detail}); "
                                           "check that it serves the teacher with --max-logprobs >= k") from None
                problem = f"HTTP {e.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                problem = str(getattr(e, "reason", e))
            if wait is not None:
                time.sleep(wait)
        raise DistillUserError(f"--teacher-url {self.url} did not {what} after {len(_RETRY_WAITS_S) + 1} tries "
                               f"({problem}); the shards written so far are kept: rerun the same command to resume")


def _targets(choice: dict, seq: np.ndarray, k: int, url: str) -> TeacherTargets:
    """One completion choice -> TeacherTargets of len(seq) rows (the layout of vllm._targets)."""
    prompt = choice.get("prompt_logprobs") or []
    top = (choice.get("logprobs") or {}).get("top_logprobs") or []
    if len(prompt) != len(seq) or len(top) != 1:
        raise DistillUserError(f"--teacher-url {url} returned {len(prompt)} prompt positions and {len(top)} generated "
                               f"for {len(seq)} tokens; serve the teacher with vLLM (prompt_logprobs)")
    positions = [{int(tok): SimpleNamespace(logprob=e["logprob"], rank=e["rank"]) for tok, e in entry.items()}
                 for entry in prompt[1:]]
    last = sorted(((lp, int(tok.removeprefix("token_id:"))) for tok, lp in top[0].items()), reverse=True)
    positions.append({tok: SimpleNamespace(logprob=lp, rank=rank) for rank, (lp, tok) in enumerate(last, 1)})
    if any(sum(1 for e in entries.values() if e.rank and e.rank <= k) < k for entries in positions):
        raise DistillUserError(f"--teacher-url {url} returned fewer than k = {k} log-probabilities a position; "
                               f"start the server with --max-logprobs >= {k}")
    prompt_ids, prompt_lp = dict_entries(positions[:-1], seq[1:], k)
    sample_ids, sample_lp = dict_entries(positions[-1:], None, k)
    topk_ids = np.concatenate([prompt_ids[:, 1:], sample_ids[:, 1:]]).astype(np.int32)
    topk_lp = np.concatenate([prompt_lp[:, 1:], sample_lp[:, 1:]])
    target = np.append(prompt_lp[:, 0], np.float32("nan"))
    return TeacherTargets(topk_ids, topk_lp, tail_logmass_from_topk(topk_lp), target)
