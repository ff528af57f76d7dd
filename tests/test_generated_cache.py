"""Stage one on text a policy wrote (`distill generate`, then `cache-teacher --corpus GENERATED`):
each record one sequence, the shards' loss mask on exactly its completion rows and the sampler's
log-probabilities beside it (teacher_cache/store.py), and stage two training only on those rows.
The policy here is the teacher itself (a tiny random Llama over the real tokenizer), so on every
completion row the teacher's cached log-probability of the sampled token is the sampler's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import one_error_line, run_cli, run_cli_ok
from teacher_cache.reader import CacheReader

# The tiny teacher's HF forward (the cache) against our student's incremental decode (the sampler),
# both fp32: measured 1.3e-5 apart at most on the default teacher (2026-12-06).
LOGPROB_ATOL = 1e-4
PROMPTS = ['{"prompt": "def add(a, b):"}', '{"prompt": "The capital of France is"}',
           '{"prompt": "import numpy as np\\n"}']


@pytest.fixture(scope="module")
def scored(tiny_teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("generated")
    (root / "prompts.jsonl").write_text("\n".join(PROMPTS) + "\n")
    run_cli_ok(["generate", "--policy", tiny_teacher, "--prompts", root / "prompts.jsonl", "--samples-per-prompt", "2",
                "--max-new-tokens", "7", "--shard-prompts", "2", "--device", "cpu", "--out", root / "gen", "-q"])
    run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--corpus", root / "gen", "--seq-len", "32", "-k", "8",
                "--shard-size", "4", "--out", root / "cache", "-q"])
    records = [json.loads(line) for f in sorted((root / "gen").glob("shard-*.jsonl")) for line in f.read_text().splitlines()]
    return root, records


def test_each_record_is_one_sequence_its_loss_rows_its_completion(scored):
    root, records = scored
    reader = CacheReader(root / "cache")
    assert reader.num_sequences == len(records) == 6
    generated = reader.manifest.spec.data.generated
    assert generated["policy"]["weights_hash"] and generated["sampler"]["max_new_tokens"] == 7
    for i, record in enumerate(records):
        start, stop, shard = _rows(reader, i)
        prompt, completion = record["prompt_ids"], record["completion_ids"]
        assert shard.input_ids[start:stop].tolist() == prompt + completion  # never joined to another record
        want = np.zeros(len(prompt) + len(completion), np.uint8)
        want[len(prompt) - 1:-1] = 1  # row t predicts token t + 1: the completion's tokens
        assert shard.loss_mask[start:stop].tolist() == want.tolist()
        sampler = shard.sampler_logprob[start:stop]
        np.testing.assert_allclose(sampler[want == 1], record["sampler_logprobs"], rtol=0, atol=1e-6)
        assert np.isnan(sampler[want == 0]).all()
        # the policy is the teacher: its cached log-prob of each sampled token is the sampler's
        np.testing.assert_allclose(shard.targets.target_logprob[start:stop][want == 1], sampler[want == 1],
                                   rtol=0, atol=LOGPROB_ATOL)


def _rows(reader, i):
    from student.data import ShardLRU

    return ShardLRU(reader, 1).sequence(i)


def test_verify_and_a_rerun_keep_the_generated_cache(scored, tiny_teacher, capsys):
    root, _ = scored
    code, out, err = run_cli(["verify", root / "cache"], capsys)
    assert code == 0, err
    code, out, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--corpus", root / "gen", "--seq-len", "32",
                              "-k", "8", "--shard-size", "4", "--out", root / "cache", "-q"], capsys)
    assert code == 0 and "already complete" in out


def test_batches_train_only_on_completion_rows(scored):
    """target_ids -1 and kd_mask False on the prompt's rows: the loss and its gradient do not move when
    the prompt rows' teacher targets change."""
    from student.data import CacheBatches
    from student.loss import distill_loss
    from student.loss_config import LossConfig

    root, records = scored
    batch = CacheBatches(CacheReader(root / "cache"), range(6), 6, shuffle=False).make_batch([(0, i) for i in range(6)])
    B, L = batch.input_ids.shape
    want = torch.zeros(B, L, dtype=torch.bool)
    for b, record in enumerate(records):
        want[b, len(record["prompt_ids"]) - 1:len(record["prompt_ids"]) + len(record["completion_ids"]) - 1] = True
    assert torch.equal(batch.kd_mask.view(B, L), want)
    assert ((batch.target_ids >= 0) == batch.kd_mask).all()
    assert torch.isfinite(batch.sampler_logprob[batch.kd_mask]).all() and batch.sampler_logprob[~batch.kd_mask].isnan().all()

    hidden = torch.randn(B * L, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(49152, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.1

    def loss_and_grad(b):
        h = hidden.clone().requires_grad_()
        loss, _ = distill_loss(h, weight, b, LossConfig(ce_weight=0.5), cache_temperature=1.0)
        loss.backward()
        return loss.item(), h.grad

    changed = batch._map(lambda t: t.clone())
    prompt_rows = batch.mask & ~batch.kd_mask
    changed.topk_logprobs[prompt_rows] -= 1.0
    changed.topk_ids[prompt_rows] = changed.topk_ids[prompt_rows].flip(1)
    (a, grad_a), (b, grad_b) = loss_and_grad(batch), loss_and_grad(changed)
    assert a == pytest.approx(b, rel=1e-12) and torch.equal(grad_a, grad_b)
    assert grad_a[prompt_rows].abs().sum() == 0  # no loss term on a prompt row


def test_a_student_trains_on_the_generated_cache_mixed_with_a_static_one(scored, tiny_teacher, tmp_path, capsys):
    root, _ = scored
    run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--max-sequences", "6", "--seq-len", "24", "-k", "8",
                "--shard-size", "4", "--out", tmp_path / "static", "-q"])
    code, out, err = run_cli(["train-student", "--cache", root / "cache", "--cache", tmp_path / "static",
                              "--teacher", tiny_teacher, "--num-layers", "1", "--steps", "3", "--batch-size", "2",
                              "--heldout", "2", "--eval-every", "3", "--device", "cpu", "--out", tmp_path / "run",
                              "-q"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in rows if r["kind"] == "train")
    assert len({r["cache"] for r in rows if r["kind"] == "cache_eval"}) == 2


def test_text_of_another_tokenizer_is_refused_before_the_teacher_runs(scored, tiny_teacher, tmp_path, capsys):
    """A generation.json naming another tokenizer hash (edited here: no second tokenizer is at hand)."""
    import shutil

    root, _ = scored
    shutil.copytree(root / "gen", tmp_path / "gen")
    manifest = json.loads((tmp_path / "gen" / "generation.json").read_text())
    manifest["tokenizer"]["hash"] = "another"
    (tmp_path / "gen" / "generation.json").write_text(json.dumps(manifest))
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--corpus", tmp_path / "gen", "--seq-len", "32",
                            "--out", tmp_path / "cache", "-q"], capsys)
    line = one_error_line(code, err)
    assert "--corpus" in line and "tokenizer another" in line
    code, _, err = run_cli(["cache-teacher", "--model", tiny_teacher, "--corpus", root / "gen", "--seq-len", "8",
                            "--out", tmp_path / "short", "-q"], capsys)
    assert "--seq-len" in one_error_line(code, err) and "never cut" in err


def test_the_reverse_kl_objective_trains_sampled_rows_and_keeps_the_forward_kl_elsewhere(scored, tiny_teacher, tmp_path):
    """distill_loss with objective reverse_kl on a batch of generated and static sequences: the
    surrogate (student/objectives.py) on the generated completion rows, the forward KL on the static
    rows, the CE mix over every row with a next token, each normalised as the loss's docstring says."""
    import kernels.fused_topk_kl as fused
    from student.data import CacheBatches
    from student.loss import distill_loss
    from student.loss_config import LossConfig
    from student.mixture import cat_batches
    from student.objectives import reverse_kl_surrogate

    root, _ = scored
    run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--max-sequences", "3", "--seq-len", "24", "-k", "8",
                "--out", tmp_path / "static", "-q"])
    batch = cat_batches([CacheBatches(CacheReader(root / "cache"), range(6), 3).make_batch([(0, i) for i in range(3)]),
                         CacheBatches(CacheReader(tmp_path / "static"), range(3), 3).make_batch([(0, i) for i in range(3)])])
    N = batch.mask.numel()
    hidden = torch.randn(N, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    weight = torch.randn(49152, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.3
    config = LossConfig(objective="reverse_kl", ce_weight=0.3, ratio_clip=1.5)
    loss, _ = distill_loss(hidden, weight, batch, config, cache_temperature=1.0)
    loss.backward()

    h = hidden.detach().clone().requires_grad_()
    kd, has_next = batch.kd_rows, batch.mask & (batch.target_ids >= 0)
    sampled = kd & ~batch.sampler_logprob.isnan()
    assert sampled.any() and (kd & ~sampled).any()  # both kinds of rows are in the batch
    ce_rows = -torch.log_softmax(h @ weight.T, -1).gather(1, batch.target_ids.clamp_min(0)[:, None])[:, 0]
    surrogate, _ = reverse_kl_surrogate(ce_rows, batch.target_logprob, batch.sampler_logprob, sampled, ratio_clip=1.5,
                                        reduction="sum")
    forward = fused.fused_topk_kl(h, weight, batch.topk_ids, batch.topk_logprobs, batch.tail_logmass,
                                  mask=kd & ~sampled, tail="bucket", reduction="sum", impl="torch")
    want = 0.7 * (surrogate + forward) / int(kd.sum()) + 0.3 * ce_rows[has_next].sum() / int(has_next.sum())
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-9)
    torch.testing.assert_close(hidden.grad, h.grad, rtol=1e-9, atol=1e-12)


def test_reverse_kl_trains_from_the_command_and_needs_generated_text(scored, tiny_teacher, tmp_path, capsys):
    root, _ = scored
    flags = ["--teacher", tiny_teacher, "--num-layers", "1", "--steps", "3", "--batch-size", "2", "--heldout", "2",
             "--eval-every", "3", "--log-every", "1", "--device", "cpu", "--objective", "reverse_kl", "--ratio-clip", "2", "-q"]
    code, out, err = run_cli(["train-student", "--cache", root / "cache", *flags, "--out", tmp_path / "run"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows if r["kind"] == "train")
    run_cli_ok(["cache-teacher", "--model", tiny_teacher, "--max-sequences", "3", "--seq-len", "24", "-k", "8",
                "--out", tmp_path / "static", "-q"])
    code, _, err = run_cli(["train-student", "--cache", tmp_path / "static", *flags, "--out", tmp_path / "no"], capsys)
    assert "--objective reverse_kl" in one_error_line(code, err)
