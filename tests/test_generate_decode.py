"""The student backend's batched decoder (pipelines/generate/decode.py): rows of other prompt
lengths in one batch, the stop check, and on a GPU the CUDA-graph step against the eager one."""

from __future__ import annotations

import pytest
import torch

from pipelines.generate.decode import BatchDecoder
from pipelines.generate.samplers import draw_tokens, nucleus_logprobs
from student.config import StudentConfig
from student.model import Student


def small_student(device: str = "cpu", dtype=torch.float32) -> Student:
    config = StudentConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = Student(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked distributions: draws far from ties
    return model.to(device=device, dtype=dtype).eval()


def decoder(model: Student, stop_ids=(), **kw) -> BatchDecoder:
    return BatchDecoder(model, lambda logits: nucleus_logprobs(logits, 0.8, 0.95), draw_tokens, stop_ids, **kw)


def prompts_and_uniforms(lengths, new: int):
    gen = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(0, 97, (n,), generator=gen).tolist()) for n in lengths]
    return prompts, torch.rand(len(lengths), new, dtype=torch.float64, generator=gen)


def full_forward_logprobs(model: Student, prompt, tokens) -> torch.Tensor:
    ids = torch.tensor([[*prompt, *tokens]], device=model.lm_head.weight.device)
    with torch.no_grad():
        logits = model.logits(model(ids))[0, len(prompt) - 1:-1]
    return nucleus_logprobs(logits, 0.8, 0.95).gather(1, torch.tensor(tokens, device=ids.device)[:, None])[:, 0].cpu()


def test_rows_of_other_prompt_lengths_decode_as_each_alone_and_as_one_forward():
    model = small_student()
    prompts, uniforms = prompts_and_uniforms([9, 1, 5, 14], new=12)
    batch = decoder(model).decode(prompts, uniforms)
    assert batch.tokens.shape == (4, 12)
    for row, prompt in enumerate(prompts):
        alone = decoder(model).decode([prompt], uniforms[row:row + 1])
        assert batch.tokens[row].tolist() == alone.tokens[0].tolist()
        torch.testing.assert_close(batch.logprobs[row], alone.logprobs[0], atol=2e-5, rtol=0)
        want = full_forward_logprobs(model, prompt, batch.tokens[row].tolist())
        torch.testing.assert_close(batch.logprobs[row], want, atol=2e-5, rtol=0)


def test_decoding_stops_once_every_row_drew_a_stop_id():
    """Checked every 32 steps: with a stop id every row draws early, 32 steps run of 100."""
    model = small_student()
    prompts, uniforms = prompts_and_uniforms([4, 6], new=100)
    free = decoder(model).decode(prompts, uniforms)
    assert free.tokens.shape[1] == 100
    stop = int(free.tokens[0, 3])
    second_row_draws = set(free.tokens[1, :32].tolist())
    stops = (stop,) if stop in second_row_draws else (stop, int(free.tokens[1, 0]))
    stopped = decoder(model, stop_ids=stops).decode(prompts, uniforms)
    assert stopped.tokens.shape[1] == 32
    assert torch.equal(stopped.tokens, free.tokens[:, :32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_graph_step_draws_what_the_eager_step_draws(dtype):
    model = small_student("cuda", dtype)
    prompts, uniforms = prompts_and_uniforms([7, 3, 11], new=40)
    graphed = decoder(model).decode(prompts, uniforms)
    eager = decoder(model, cuda_graph=False).decode(prompts, uniforms)
    assert torch.equal(graphed.tokens, eager.tokens)
    torch.testing.assert_close(graphed.logprobs, eager.logprobs, atol=0, rtol=0)
    if dtype == torch.float32:  # bf16 rounds the one-forward pass otherwise than the step-by-step one
        for row, prompt in enumerate(prompts):
            want = full_forward_logprobs(model, prompt, graphed.tokens[row].tolist())
            torch.testing.assert_close(graphed.logprobs[row], want, atol=2e-5, rtol=0)
