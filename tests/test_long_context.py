"""student/long_context/: chunk-recurrent training gives the loss and every parameter gradient
of full backpropagation (fp32, CPU; Llama, Qwen2, Qwen3 with GQA, the sparse FFN on and off,
chunks and pages that do not divide the sequence), chunked evaluation equals whole-sequence
evaluation, `--deterministic` training with --chunk-tokens gives the losses of training
without it, step by step, and (GPU) offloaded pages, prefetched across layers, give resident pages'
gradients."""

from __future__ import annotations

import dataclasses

from collections import Counter

import pytest
import torch

from distill.configs import ConfigError
from student.data import Batch
from student.long_context.config import LongContextConfig, chunk_bounds, sparse_grad_pages
from student.long_context.engine import Part, chunk_recurrent_backward, chunked_forward, kept_attention_from
from student.long_context.store import page_set_bounds, select_pages
from student.loss import LossConfig, distill_loss
from student.model import Student, to_relu_gate
from student.sparse_ffn import l1_penalty
from test_student_model import saved_hf
from test_trainer import config as train_config, rows, tiny  # noqa: F401  (tiny is a fixture)

REL = 1e-5  # the bound: fp32 chunk-recurrent against full backpropagation, relative to the largest entry
# bf16 on the GPU: the loss relative to itself, each gradient in relative norm (test_gpu_bf16_...).
BF16_LOSS_REL, BF16_GRAD_REL = 2e-3, 3e-2
L1 = 0.05


def make_batch(lengths: list[int], vocab: int, k: int = 6, seed: int = 0) -> Batch:
    """Random but valid cached targets for ragged sequences padded to max(lengths)."""
    gen = torch.Generator().manual_seed(seed)
    B, L = len(lengths), max(lengths)
    input_ids = torch.randint(0, vocab, (B, L), generator=gen)
    topk_ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(B * L)])
    logits = torch.randn(B * L, k + 1, generator=gen) * 2
    logp = torch.log_softmax(logits, -1)
    topk_logprobs, _ = logp[:, :k].sort(dim=-1, descending=True)
    tail = logp[:, k]
    mask = (torch.arange(L)[None] < torch.tensor(lengths)[:, None]).reshape(-1)
    target = torch.full((B, L), -1)
    for b, n in enumerate(lengths):
        target[b, :n - 1] = input_ids[b, 1:n]
    target = target.reshape(-1)
    return Batch(input_ids, topk_ids, topk_logprobs, tail, target, torch.full((B * L,), float("nan")), mask)


def loss_of(model, hidden, terms, rows, part=None, l1=0.0, config=LossConfig(tail="bucket", ce_weight=0.25)):
    hidden_ND = hidden.reshape(-1, hidden.shape[-1])
    loss, kl = distill_loss(hidden_ND, model.lm_head_weight.to(hidden_ND.dtype), rows, config,
                            cache_temperature=1.0, whole=part.whole if part else None)
    share = part.share if part else 1.0
    if l1 and terms:
        loss = loss + L1 * l1_penalty(terms) * share
    return loss, kl


def full_backprop(model, batch, l1):
    model.zero_grad()
    hidden, terms = model(batch.input_ids, token_mask=batch.mask, return_ffn_terms=True)
    loss, _ = loss_of(model, hidden, terms, batch, l1=l1)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_rel(got, want, name):
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    assert err <= REL, f"{name}: relative error {err:.2e} > {REL:g}"


# Every family and the sparse FFN each meet chunks shorter than a page and not dividing the
# sequence (5, 13), chunks of exactly a page (16, which also runs without layer checkpointing),
# and one chunk longer than the sequence (64).
@pytest.mark.parametrize("family,sparse,chunk_tokens,page_tokens", [
    ("llama", False, 5, 16), ("llama", False, 64, 16), ("qwen2", False, 13, 32), ("qwen2", False, 16, 16),
    ("qwen3", False, 5, 16), ("qwen3", False, 16, 16), ("llama", True, 13, 32), ("qwen3_relu", True, 5, 16)])
def test_chunk_recurrent_gradients_equal_full_backprop(family, sparse, chunk_tokens, page_tokens, tmp_path):
    _, folder = saved_hf(family, tmp_path)
    model = Student.from_pretrained(folder)
    if sparse:
        to_relu_gate(model)
    batch = make_batch([37, 29], vocab=model.config.vocab_size, seed=chunk_tokens)
    l1 = L1 if sparse else 0.0
    want_loss, want_grads = full_backprop(model, batch, l1)

    model.zero_grad()
    config = LongContextConfig(chunk_tokens=chunk_tokens, page_tokens=page_tokens,
                               checkpoint_layers=chunk_tokens != 16)  # both ways of keeping activations
    total = batch.num_tokens
    chunk_loss = lambda hidden, rows, terms, part: loss_of(model, hidden, terms, rows, part, l1)
    shares = []
    spy = lambda hidden, rows, terms, part: (shares.append(part.share), chunk_loss(hidden, rows, terms, part))[1]
    loss, _ = chunk_recurrent_backward(model, batch, spy, config, device="cpu")

    assert len(shares) == len(chunk_bounds(37, chunk_tokens)) and sum(shares) == pytest.approx(1.0)
    assert shares[0] == pytest.approx(sum(1 for s in range(37 - (37 - 1) % chunk_tokens - 1, 37)
                                          for n in (37, 29) if s < n) / total)
    assert_rel(loss, want_loss, "loss")
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert_rel(p.grad, want_grads[name], name)


def generated_rows(batch: Batch, seed: int = 1) -> Batch:
    """`batch` as a cache of generated text holds it: each sequence's second half its completion
    (kd_mask), with the teacher's and the sampler's log-prob of each next token there."""
    gen = torch.Generator().manual_seed(seed)
    B, L = batch.input_ids.shape
    completion = (torch.arange(L)[None] >= L // 3).expand(B, L).reshape(-1) & (batch.target_ids >= 0)
    teacher = torch.where(completion, -torch.rand(B * L, generator=gen) * 4, float("nan"))
    sampler = torch.where(completion, -torch.rand(B * L, generator=gen) * 4, float("nan"))
    return dataclasses.replace(batch, target_logprob=teacher, kd_mask=completion, sampler_logprob=sampler)


@pytest.mark.parametrize("objective", ["jsd", "reverse_kl"])
def test_the_objectives_compose_with_chunk_recurrent_training(objective, tmp_path):
    """The JSD and the reverse-KL surrogate (on a generated batch) through chunk-recurrent training
    give full backprop's loss and gradients, as the forward KL does above."""
    _, folder = saved_hf("qwen2", tmp_path)
    model = Student.from_pretrained(folder)
    batch = make_batch([37, 29], vocab=model.config.vocab_size, seed=3)
    if objective == "reverse_kl":
        batch = generated_rows(batch)
    config = LossConfig(tail="bucket", ce_weight=0.25, objective=objective, beta=0.3, ratio_clip=2.0)
    model.zero_grad()
    hidden = model(batch.input_ids, token_mask=batch.mask)
    want_loss, _ = loss_of(model, hidden, [], batch, config=config)
    want_loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    chunk_loss = lambda hidden, rows, terms, part: loss_of(model, hidden, terms, rows, part, config=config)
    loss, _ = chunk_recurrent_backward(model, batch, chunk_loss, LongContextConfig(chunk_tokens=13, page_tokens=16),
                                       device="cpu")
    assert_rel(loss, want_loss.detach(), "loss")
    for name, p in model.named_parameters():
        assert_rel(p.grad, want_grads[name], name)


class SparseReferenceStore:
    """Plain autograd reference of sparse mode: keeps every past key/value with its graph (as
    ListKVStore) and masks the attention to the pages `select_pages` picks plus the chunk's own."""

    def __init__(self, page_tokens: int, budget: int):
        self.P, self.budget, self.kv, self.start = page_tokens, budget, {}, 0

    def past_length(self):
        return self.start

    def attend(self, layer, q, k, v):
        if layer in self.kv:
            k, v = torch.cat([self.kv[layer][0], k], 2), torch.cat([self.kv[layer][1], v], 2)
        self.kv[layer] = (k, v)
        B, Hkv, Tk, D = k.shape
        T, j0 = q.shape[2], self.start // self.P
        allowed = torch.ones(B, Tk, dtype=torch.bool)
        if j0 > self.budget:
            mean_k = k[:, :, :j0 * self.P].detach().view(B, Hkv, j0, self.P, D).mean(3).permute(2, 0, 1, 3)
            picked = select_pages(q, mean_k, self.budget)
            allowed[:, :j0 * self.P] = False
            for b in range(B):
                for j in picked[b].tolist():
                    allowed[b, j * self.P:(j + 1) * self.P] = True
        causal = torch.arange(Tk)[None] <= torch.arange(self.start, self.start + T)[:, None]  # [T, Tk]
        mask = (causal[None] & allowed[:, None])[:, None]  # [B, 1, T, Tk]
        groups = q.shape[1] // Hkv
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# Both cases are long enough that the gradient pages have fewer rows than there are pages (7, 25)
# (sparse_grad_pages): the store asserts it never needs more, so passing checks that bound too.
@pytest.mark.parametrize("family,L,chunk,budget,grad_pages", [("qwen3", 100, 20, 2, 5), ("qwen3", 400, 32, 1, 14)])
def test_sparse_pages_gradients_equal_autograd_through_the_same_sparse_attention(family, L, chunk, budget, grad_pages,
                                                                                 tmp_path):
    """GQA groups of 3 and q/k norms; chunks not page-aligned."""
    assert sparse_grad_pages(L, chunk, 16, budget) == grad_pages
    _, folder = saved_hf(family, tmp_path)
    model = Student.from_pretrained(folder)
    batch = make_batch([L, L - 17], vocab=model.config.vocab_size, seed=11)
    config = LongContextConfig(chunk_tokens=chunk, page_tokens=16, sparse_pages=budget)
    chunk_loss = lambda hidden, rows, terms, part: loss_of(model, hidden, terms, rows, part)

    store, parts = SparseReferenceStore(16, budget), []
    whole = (batch.num_tokens, int((batch.mask & (batch.target_ids >= 0)).sum()))
    for s, e in chunk_bounds(L, chunk):
        store.start = s
        rows = batch.positions(s, e)
        hidden = model(batch.input_ids[:, s:e], kv_store=store, token_mask=rows.mask)
        parts.append(loss_of(model, hidden, [], rows, Part(*whole, share=0.0))[0])
    want_loss = sum(parts)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got_loss, _ = chunk_recurrent_backward(model, batch, chunk_loss, config, device="cpu")
    assert_rel(got_loss, want_loss.detach(), "loss")
    for name, p in model.named_parameters():
        assert_rel(p.grad, want[name], name)
    # and it is another function than dense attention: the gradients move far beyond the tolerance
    model.zero_grad()
    chunk_recurrent_backward(model, batch, chunk_loss, LongContextConfig(chunk_tokens=chunk, page_tokens=16), device="cpu")
    moved = max(((p.grad - want[n]).abs().max() / want[n].abs().max()).item() for n, p in model.named_parameters())
    assert moved > 100 * REL


def test_a_sparse_chunks_own_pages_take_no_gradient_rows(tmp_path, monkeypatch):
    """Sparse mode's backward keeps a chunk's own pages' gradients on the device until they are
    complete: every gradient row it reads or writes (`_GradPages.rows`) is of a page the chunk read
    as a past page or began inside, before its first whole page. Offloaded, that is what spares the
    own pages' gradients a trip to the host and back (chunks not page-aligned; a spy records them)."""
    import student.long_context.engine as engine
    from student.long_context.store import _GradPages

    stores, seen = [], []
    real_store, real_rows = engine.store_for_model, _GradPages.rows
    monkeypatch.setattr(engine, "store_for_model", lambda *a, **kw: stores.append(real_store(*a, **kw)) or stores[-1])

    def rows(grads, slots):
        store = stores[-1]
        seen.append((slots.max().item(), -(-store.start // store.P) * store.B))
        return real_rows(grads, slots)

    monkeypatch.setattr(_GradPages, "rows", rows)
    _, folder = saved_hf("qwen3", tmp_path)
    model = Student.from_pretrained(folder)
    batch = make_batch([100, 83], vocab=model.config.vocab_size, seed=11)
    config = LongContextConfig(chunk_tokens=20, page_tokens=16, sparse_pages=2)
    chunk_recurrent_backward(model, batch, lambda hidden, rows, terms, part: loss_of(model, hidden, terms, rows, part),
                             config, device="cpu")
    assert len(seen) > model.config.num_layers * 4  # selected pages, past pages and begun pages, each layer
    assert all(slot < first_whole for slot, first_whole in seen)


def test_gradient_scale_and_accumulation(tmp_path):
    """grad_scale scales every gradient, and a second call adds to .grad like a plain backward."""
    _, folder = saved_hf("qwen3", tmp_path)
    model = Student.from_pretrained(folder)
    batch = make_batch([21], vocab=model.config.vocab_size)
    _, want = full_backprop(model, batch, 0.0)
    model.zero_grad()
    chunk_loss = lambda hidden, rows, terms, part: loss_of(model, hidden, terms, rows, part)
    config = LongContextConfig(chunk_tokens=8, page_tokens=16)
    for _ in range(2):
        chunk_recurrent_backward(model, batch, chunk_loss, config, device="cpu", grad_scale=0.5)
    for name, p in model.named_parameters():
        assert_rel(p.grad, want[name], name)


def test_chunked_forward_equals_whole(tmp_path):
    _, folder = saved_hf("qwen2", tmp_path)
    model = Student.from_pretrained(folder).eval()
    batch = make_batch([30, 23], vocab=model.config.vocab_size)
    whole = list(chunked_forward(model, batch.input_ids, batch.mask, LongContextConfig()))
    assert [(s, e) for s, e, _, _ in whole] == [(0, 30)]
    chunks = list(chunked_forward(model, batch.input_ids, batch.mask, LongContextConfig(chunk_tokens=7,
                                                                                        page_tokens=16)))
    assert [(s, e) for s, e, _, _ in chunks] == chunk_bounds(30, 7) == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 30)]
    torch.testing.assert_close(torch.cat([h for _, _, h, _ in chunks], dim=1), whole[0][2], atol=1e-5, rtol=1e-5)


def test_config_errors_name_the_option():
    with pytest.raises(ConfigError, match="page_tokens"):
        LongContextConfig(chunk_tokens=8, page_tokens=48)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        LongContextConfig(chunk_tokens=0)
    with pytest.raises(ConfigError, match="kv_offload.*--chunk-tokens"):
        LongContextConfig(kv_offload=True)
    with pytest.raises(ConfigError, match="sparse_pages.*--chunk-tokens"):
        LongContextConfig(sparse_pages=8)
    assert str(ConfigError("page_tokens", "x").as_option()).startswith("--page-tokens")


def test_deterministic_training_with_chunks_matches_whole_sequences(tiny, tmp_path):  # noqa: F811
    whole = train_config(tiny, tmp_path / "whole", steps=4, save_every=0, eval_every=2)
    chunked = whole.with_flat(out=str(tmp_path / "chunked"), chunk_tokens=7, page_tokens=16)
    from student.trainer import train

    train(whole, progress=False)
    train(chunked, progress=False)
    got, want = rows(tmp_path / "chunked"), rows(tmp_path / "whole")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=REL)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
    for g, w in zip(rows(tmp_path / "chunked", "eval"), rows(tmp_path / "whole", "eval")):
        assert g["kl"] == pytest.approx(w["kl"], rel=REL) and g["top1"] == w["top1"]
    # `distill eval` of the chunked run evaluates as it trained (in chunks), and equals the whole run's
    from student.evaluate import evaluate_run_or_folder

    got_eval = evaluate_run_or_folder(tmp_path / "chunked", device="cpu")["after"]
    want_eval = evaluate_run_or_folder(tmp_path / "whole", device="cpu")["after"]
    assert got_eval.kl == pytest.approx(want_eval.kl, rel=REL) and got_eval.top1 == want_eval.top1


# --- GPU: bf16 at 8K tokens, resident and offloaded pages ---------------------------------------

def gpu_student(seed=0) -> Student:
    from student.config import StudentConfig

    torch.manual_seed(seed)
    config = StudentConfig(model_type="qwen2", vocab_size=2048, hidden_size=512, intermediate_size=1408, num_layers=4,
                           num_heads=8, num_kv_heads=2, head_dim=64, attention_bias=True, rope_theta=1e6,
                           tie_word_embeddings=True)
    return Student(config).cuda()


def grads_of(model, batch, config: LongContextConfig | None):
    """Loss and parameter gradients under bf16 autocast (fp32 master weights), as the trainer runs."""
    model.zero_grad()
    amp = torch.bfloat16
    if config is None:
        with torch.autocast("cuda", dtype=amp):
            hidden = model(batch.input_ids, token_mask=batch.mask)
        loss, _ = loss_of(model, hidden.to(torch.bfloat16), [], batch)
        loss.backward()
    else:
        chunk_loss = lambda hidden, rows, terms, part: loss_of(model, hidden.to(torch.bfloat16), terms, rows, part)
        loss, _ = chunk_recurrent_backward(model, batch, chunk_loss, config, device="cuda", autocast_dtype=amp)
    return loss.float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# keep 1: pass 1 keeps one chunk's attention outputs on the host, pass 2 attends again for the rest
@pytest.mark.parametrize("offload,keep", [(False, None), (True, None), (True, 1)])
def test_gpu_bf16_chunk_recurrent_gradients_match_full_backprop_at_8k(offload, keep):
    model = gpu_student()
    batch = make_batch([8192], vocab=model.config.vocab_size, k=16, seed=3).to("cuda")
    want_loss, want = grads_of(model, batch, None)
    config = LongContextConfig(chunk_tokens=1536, page_tokens=64, kv_offload=offload, offload_pages=40,
                               keep_attention_chunks=keep)
    got_loss, got = grads_of(model, batch, config)
    assert_bf16_close(got_loss, got, want_loss, want)


def assert_bf16_close(got_loss, got, want_loss, want):
    assert abs(got_loss.item() - want_loss.item()) <= BF16_LOSS_REL * abs(want_loss.item())
    for name in want:
        err = ((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30)).item()
        assert err <= BF16_GRAD_REL, f"{name}: relative norm error {err:.3g} (bf16 tolerance {BF16_GRAD_REL:g})"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("offload_pages", [7, 20])  # the prefetched first set whole (7), cut at the chunk (20)
def test_gpu_offloaded_pages_prefetched_across_layers_match_resident_pages(offload_pages, monkeypatch):
    """--kv-offload with several page sets per layer: each layer's first set, copied while the
    layer before attended, is the set that layer reads (the store counts every prefetch used, none
    dropped: pass 1 and the last chunk's forward without grads, pass 2's backward with them, and
    the evaluation's chunked forward), and gradients and hidden states equal resident pages'."""
    import student.long_context.engine as engine

    stores = []
    real = engine.store_for_model
    monkeypatch.setattr(engine, "store_for_model", lambda *a, **kw: stores.append(real(*a, **kw)) or stores[-1])
    model = gpu_student()
    L, P, chunk = 4096, 64, 1000
    batch = make_batch([L, 3001], vocab=model.config.vocab_size, k=16, seed=5).to("cuda")
    resident = LongContextConfig(chunk_tokens=chunk, page_tokens=P, offload_pages=offload_pages)
    offloaded = LongContextConfig(chunk_tokens=chunk, page_tokens=P, offload_pages=offload_pages, kv_offload=True)
    want_loss, want = grads_of(model, batch, resident)
    got_loss, got = grads_of(model, batch, offloaded)
    store = stores[-1]
    assert store.offload
    layers = model.config.num_layers - 1  # every layer but the first of a pass has its set prefetched
    past = [s // P > 0 for s, _ in chunk_bounds(L, chunk)]  # chunks with pages before them
    assert store.prefetch_count == Counter({("used", False): layers * (sum(past[:-1]) + past[-1]),
                                            ("used", True): layers * sum(past)})
    assert_bf16_close(got_loss, got, want_loss, want)

    with torch.no_grad():
        hidden = [[h for _, _, h, _ in chunked_forward(model, batch.input_ids, batch.mask, config,
                                                       autocast_dtype=torch.bfloat16)]
                  for config in (resident, offloaded)]
    assert stores[-1].offload and stores[-1].prefetch_count == Counter({("used", False): layers * sum(past)})
    for want_h, got_h in zip(*hidden):
        err = ((got_h.float() - want_h.float()).norm() / want_h.float().norm()).item()
        assert err <= BF16_GRAD_REL, f"hidden states: relative norm error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sparse_pages_offloaded_match_resident():
    """Sparse mode's gradient pages (`_GradPages`) in pinned host memory give what they give on the
    GPU, bf16, with fewer gradient rows than pages (`sparse_grad_pages`)."""
    model = gpu_student()
    L, P, chunk, budget = 8192, 64, 1000, 8
    assert sparse_grad_pages(L, chunk, P, budget) < L // P
    batch = make_batch([L, 6001], vocab=model.config.vocab_size, k=16, seed=7).to("cuda")
    resident = LongContextConfig(chunk_tokens=chunk, page_tokens=P, sparse_pages=budget)
    want_loss, want = grads_of(model, batch, resident)
    got_loss, got = grads_of(model, batch, LongContextConfig(chunk_tokens=chunk, page_tokens=P, sparse_pages=budget,
                                                             kv_offload=True))
    assert_bf16_close(got_loss, got, want_loss, want)


@pytest.mark.parametrize("first,num,final,step", [
    (0, 10, 4, 3), (0, 10, 0, 3), (0, 10, 10, 4), (0, 10, 7, 20), (0, 11, 9, 3), (5, 12, 5, 3), (0, 1, 0, 1)])
def test_offloaded_page_sets_cover_the_pages_and_split_at_the_chunks_first(first, num, final, step):
    """The page sets an offloaded attention call reads cover its pages once, in order, at most
    `offload_pages` each, and none holds pages both before and from the chunk's first page: the
    first set, which the layer before prefetches, then holds only pages earlier chunks wrote."""
    bounds = page_set_bounds(first, num, final, step)
    assert [j for j0, j1 in bounds for j in range(j0, j1)] == list(range(first, num))
    assert all(0 < j1 - j0 <= step for j0, j1 in bounds)
    assert not any(j0 < final < j1 for j0, j1 in bounds)
    if final > first:
        assert bounds[0] == (first, min(first + step, final))


@pytest.mark.parametrize("checkpoint_layers", [True, False])
def test_attention_runs_once_per_layer_and_chunk(tmp_path, monkeypatch, checkpoint_layers):
    """Pass 2 and the backward's rerun of a checkpointed layer take the attention output of pass 1
    (the last chunk's, of its first run in pass 2): the page attention runs once per layer and
    chunk in the whole step (a spy counts the calls)."""
    import kernels.page_attention as page_attention

    _, folder = saved_hf("qwen2", tmp_path)
    model = Student.from_pretrained(folder)
    batch = make_batch([40], vocab=model.config.vocab_size)
    calls = []
    real = page_attention.page_attention_forward
    monkeypatch.setattr(page_attention, "page_attention_forward", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    chunk_loss = lambda hidden, rows, terms, part: loss_of(model, hidden, terms, rows, part)
    config = LongContextConfig(chunk_tokens=16, page_tokens=16, checkpoint_layers=checkpoint_layers)
    chunk_recurrent_backward(model, batch, chunk_loss, config, device="cpu")
    assert len(calls) == model.config.num_layers * len(chunk_bounds(40, 16))


@pytest.mark.parametrize("keep", [0, 1, None])
def test_keeping_fewer_chunks_attention_attends_again_for_the_rest_with_the_same_gradients(tmp_path, monkeypatch,
                                                                                           keep):
    """keep_attention_chunks: pass 1 keeps the last `keep` chunks' attention (before the final one);
    pass 2 attends again for each chunk it did not keep, one more call per layer, and the loss and
    gradients stay those of full backpropagation."""
    import kernels.page_attention as page_attention

    _, folder = saved_hf("qwen2", tmp_path)
    model = Student.from_pretrained(folder)
    batch = make_batch([45, 30], vocab=model.config.vocab_size, seed=3)
    want_loss, want_grads = full_backprop(model, batch, 0.0)
    model.zero_grad()
    calls = []
    real = page_attention.page_attention_forward
    monkeypatch.setattr(page_attention, "page_attention_forward", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    chunk_loss = lambda hidden, rows, terms, part: loss_of(model, hidden, terms, rows, part)
    config = LongContextConfig(chunk_tokens=13, page_tokens=16, keep_attention_chunks=keep)
    loss, _ = chunk_recurrent_backward(model, batch, chunk_loss, config, device="cpu")
    chunks = len(chunk_bounds(45, 13))  # 4: pass 1 runs the first 3
    not_kept = chunks - 1 - (chunks - 1 if keep is None else keep)
    assert len(calls) == model.config.num_layers * (chunks + not_kept)
    assert_rel(loss, want_loss, "loss")
    for name, p in model.named_parameters():
        assert_rel(p.grad, want_grads[name], name)


def test_kept_attention_starts_at_the_last_chunks_pass_1_runs():
    bounds = chunk_bounds(45, 13)  # (0, 13), (13, 26), (26, 39), (39, 45)
    assert [kept_attention_from(bounds, n) for n in (None, 5, 3, 2, 1, 0)] == [0, 0, 0, 13, 26, 45]
    assert kept_attention_from(chunk_bounds(10, 13), None) == 10  # one chunk: pass 1 runs nothing



def test_the_planner_counts_the_kept_attention_of_the_chunks_pass_1_keeps(tmp_path):
    from types import SimpleNamespace

    from student.planner.profile import _kv_pages

    _, folder = saved_hf("qwen2", tmp_path)
    model = Student.from_pretrained(folder)
    c = model.config
    kept = lambda keep: _kv_pages(model, SimpleNamespace(device="cpu", long=LongContextConfig(
        chunk_tokens=13, page_tokens=16, keep_attention_chunks=keep)), (2, 45), None).kept_bytes
    per_token = c.num_layers * 2 * c.num_heads * (c.head_dim * 4 + 4)  # batch 2, fp32 outputs and lse
    assert [kept(n) for n in (None, 3, 2, 1, 0)] == [39 * per_token, 39 * per_token, 26 * per_token,
                                                     13 * per_token, 0]


def test_the_planner_counts_the_sparse_stores_gradient_pages_and_mean_keys(tmp_path):
    """In sparse mode the planner's key/value bytes are the store's: key and value pools, each
    page's mean key, and gradient pages for `sparse_grad_pages` pages a layer (not every page);
    beside them the sequence's int64 ids and bool mask, which the engine holds."""
    from types import SimpleNamespace

    from student.long_context.store import _GradPages, store_for_model
    from student.planner.profile import _kv_pages

    _, folder = saved_hf("qwen2", tmp_path)
    model = Student.from_pretrained(folder)
    B, L, long = 2, 400, LongContextConfig(chunk_tokens=32, page_tokens=16, sparse_pages=1)
    planned = _kv_pages(model, SimpleNamespace(device="cpu", long=long), (B, L), None)
    store = store_for_model(model, B, L, long, torch.float32, "cpu")
    grads = _GradPages(store.num_pages * B, store.grad_page_rows, store.page_shape, device="cpu", pin=False)
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
    held = nbytes(store.k + store.v + store.mean_k) + model.config.num_layers * nbytes([grads.dk, grads.dv])
    assert store.grad_page_rows == B * sparse_grad_pages(L, 32, 16, 1) < B * store.num_pages
    assert planned.bytes()[0] == held + planned.kept_bytes + B * L * 9


def test_the_profile_times_pass_2s_forward_on_pass_1s_kept_attention(tmp_path, monkeypatch):
    """step_profile measures a chunk's layer three ways: pass 1 (attends, keeps its output), pass 2
    taking that output (no attention call), and pass 2 attending: two attention calls a run."""
    import kernels.page_attention as page_attention
    from student.planner.profile import CHUNK_KEYS, ProfileSettings, _measure_chunks
    from student.trainer import TrainConfig

    _, folder = saved_hf("qwen2", tmp_path)
    model = Student.from_pretrained(folder)
    batch = make_batch([45, 30], vocab=model.config.vocab_size, k=32, seed=5)
    config = TrainConfig.from_flat(cache="unused", out="unused", student=str(folder), device="cpu", dtype="float32",
                                   chunk_tokens=13, page_tokens=16)
    calls = []
    real = page_attention.page_attention_forward
    monkeypatch.setattr(page_attention, "page_attention_forward", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    measured = _measure_chunks(model, batch, config, None, ProfileSettings(repeats=1), 1.0)
    assert len(calls) == 2 * model.config.num_layers * 2 * 2  # first and last chunk, 2 runs, 2 attending calls
    assert measured["chunks"] == 4 and measured["pass1_s"] > 0
    assert all(set(layer) == {"forward_s", "backward_s", "weight_bytes", "boundary_bytes", "keep_bytes",
                              "workspace_bytes", "master_bytes", *CHUNK_KEYS} for layer in measured["layers"])


def test_the_profile_builds_its_two_chunks_stores_one_at_a_time(tmp_path):
    """The first and last chunk's key/value stores each hold the whole sequence's pages (at the 7B's
    192K tokens, tens of GB pinned): the first is gone, with no garbage collection asked, before the
    second is built."""
    import weakref

    from student.long_context.store import store_for_model
    from student.planner.profile import ProfileSettings, _measure_chunks
    from student.trainer import TrainConfig

    _, folder = saved_hf("qwen2", tmp_path)
    model = Student.from_pretrained(folder)
    batch = make_batch([45, 30], vocab=model.config.vocab_size, k=32, seed=5)
    config = TrainConfig.from_flat(cache="unused", out="unused", student=str(folder), device="cpu", dtype="float32",
                                   chunk_tokens=13, page_tokens=16)
    built, alive_at_build = [], []

    def spy(*args, **kwargs):  # a spy: records which stores are alive when the next is built
        alive_at_build.append(sum(ref() is not None for ref in built))
        store = store_for_model(*args, **kwargs)
        built.append(weakref.ref(store))
        return store

    _measure_chunks(model, batch, config, None, ProfileSettings(repeats=1), 1.0, build_store=spy)
    assert alive_at_build == [0, 0]


@pytest.mark.parametrize("keep,want_forward", [(None, (1 + 2 + 3 + 40) / 4), (1, (10 + 20 + 3 + 40) / 4),
                                               (0, (10 + 20 + 30 + 40) / 4)])
def test_a_layers_pass_2_forward_is_the_mean_over_chunks_kept_or_attending(keep, want_forward):
    """Chunk j's seconds interpolate the first and last chunk's; a chunk pass 1 kept takes the kept
    forward, the others (and the last) the attending one; pass 1 is the no-grad forwards of all but
    the last chunk."""
    from student.planner.profile import _chunk_layers

    first = {"forward_s": 10.0, "kept_forward_s": 1.0, "pass1_forward_s": 8.0, "backward_s": 5.0, "keep_bytes": 7}
    last = {"forward_s": 40.0, "kept_forward_s": 4.0, "pass1_forward_s": 38.0, "backward_s": 9.0, "keep_bytes": 11}
    measured = _chunk_layers([first], [last], chunk_bounds(45, 13), keep)
    # chunk j of 4: attending 10, 20, 30, 40; kept 1, 2, 3, 4; pass 1 8, 18, 28 (the last chunk not run)
    (layer,) = measured["layers"]
    assert layer == {"forward_s": pytest.approx(want_forward), "backward_s": 7.0, "keep_bytes": 11,
                     "first_forward_s": 10.0, "last_forward_s": 40.0, "first_kept_forward_s": 1.0,
                     "last_kept_forward_s": 4.0}
    assert measured["pass1_s"] == pytest.approx(8 + 18 + 28)


def test_sparse_chunks_attend_at_most_the_budget_and_pass_1_pays_each_selection():
    """With a budget of one chunk's worth of past pages, chunks 1..3 attend as much as the last one
    (not j / 3 of it); each chunk past the budget (2 and 3, the last in pass 2) selects once, in
    proportion to its past: the last chunk's selection seconds times 2/3 and 1."""
    from student.planner.profile import _chunk_layers

    first = {"forward_s": 10.0, "kept_forward_s": 1.0, "pass1_forward_s": 8.0, "backward_s": 5.0, "keep_bytes": 7}
    last = {"forward_s": 40.0, "kept_forward_s": 4.0, "pass1_forward_s": 38.0, "backward_s": 9.0, "keep_bytes": 11}
    measured = _chunk_layers([first], [last], chunk_bounds(64, 16), 0, budget_chunks=1.0, select_s=3.0)
    assert measured["layers"][0]["forward_s"] == pytest.approx((10 + 40 + 40 + 40) / 4)
    assert measured["pass1_s"] == pytest.approx(8 + 38 + 38 + 3.0 * (2 / 3 + 1))
    dense = _chunk_layers([first], [last], chunk_bounds(64, 16), 0)
    assert dense["layers"][0]["forward_s"] == pytest.approx((10 + 20 + 30 + 40) / 4)


def test_the_profile_times_a_selection_only_where_a_chunk_selects(tmp_path):
    """`_select_seconds` times `select_pages` over every past page of the chunk a store is begun at,
    and is 0 where the chunk's past is within the budget (the store selects nothing there)."""
    from student.long_context.store import store_for_model
    from student.planner.profile import ProfileSettings, _select_seconds

    _, folder = saved_hf("qwen2", tmp_path)
    model = Student.from_pretrained(folder)
    long = LongContextConfig(chunk_tokens=32, page_tokens=16, sparse_pages=2)
    assert long.budget_chunks == 1.0
    seconds = {}
    for start in (32, 64):  # 2 past pages (the budget), then 4
        store = store_for_model(model, 2, 128, long, torch.float32, "cpu")
        store.begin(start, start + 32, grad=True)
        seconds[start] = _select_seconds(store, model.config.num_heads, 32, None, ProfileSettings(repeats=1), "cpu")
    assert seconds[32] == 0.0 < seconds[64]


@pytest.mark.parametrize("sparse_pages", [None, 2])
def test_a_store_makes_every_layers_gradient_pools_ahead_as_its_first_backwards_would(tmp_path, sparse_pages):
    """`make_gradient_pools`: dense, fp32 pages like the key pools (zeros where resident); sparse,
    each layer's `_GradPages` of `grad_page_rows` rows. A backward then finds them made."""
    from student.long_context.store import store_for_model

    _, folder = saved_hf("qwen2", tmp_path)
    model = Student.from_pretrained(folder)
    long = LongContextConfig(chunk_tokens=32, page_tokens=16, sparse_pages=sparse_pages)
    store = store_for_model(model, 2, 128, long, torch.float32, "cpu")
    store.make_gradient_pools()
    for layer in range(model.config.num_layers):
        if sparse_pages is None:
            assert store.dk[layer].shape == store.k[layer].shape and not store.dv[layer].any()
        else:
            assert store.grad_pages[layer].dk.shape == (store.grad_page_rows, *store.page_shape)
            assert store.dk[layer] is None
