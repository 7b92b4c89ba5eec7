"""On-policy distillation's loss (training.md §8 tests): >= 0, zero iff equal, a brute-force match on a
tiny vocabulary, the gradient moves the student towards the teacher, no gradient reaches the teacher;
and a distillation step through the learner on the student's own engine samples."""

import torch

from dsv41.config import tiny
from dsv41.engine import SamplingParams
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.optim.groups import OptimConfig, build_optimizers
from dsv41.rl.distill import distill_step, opd_loss, reverse_kl, token_advantages
from dsv41.rl.policy import ReplayPolicy
from dsv41.rl.rollout import RolloutRequest, RolloutWorker, rollout_engine_config
from dsv41.tokenizer import ByteTokenizer


def test_reverse_kl_is_nonnegative_and_zero_iff_equal():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(64, 11, generator=g) * 3, torch.randn(64, 11, generator=g) * 3
    kl = reverse_kl(s, t)
    assert torch.all(kl > 0)
    assert torch.all(reverse_kl(s, s).abs() < 1e-6)
    assert torch.all(reverse_kl(s, s + 5.0).abs() < 1e-5)  # the same distribution (a shift of the logits)


def test_reverse_kl_matches_a_brute_force_sum():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(3, generator=g), torch.randn(3, generator=g)
    ps, pt = [float(x) for x in s.softmax(-1)], [float(x) for x in t.softmax(-1)]
    import math

    brute = sum(a * (math.log(a) - math.log(b)) for a, b in zip(ps, pt))
    assert abs(float(reverse_kl(s, t)) - brute) < 1e-6
    # and the per-token RL view: E_{v ~ pi_s}[-advantage(v)] is the same KL
    logs, logt = s.log_softmax(-1), t.log_softmax(-1)
    assert abs(float((logs.exp() * -token_advantages(logs, logt)).sum()) - brute) < 1e-6


def test_the_gradient_moves_the_student_towards_the_teacher_and_not_the_teacher():
    student = torch.tensor([2.0, 0.0, -1.0], requires_grad=True)
    teacher = torch.tensor([-1.0, 0.5, 1.5], requires_grad=True)
    before = float(reverse_kl(student, teacher))
    opd_loss(student.view(1, 1, 3), teacher.view(1, 1, 3), torch.ones(1, 1, dtype=torch.bool)).backward()
    assert teacher.grad is None
    with torch.no_grad():
        after = float(reverse_kl(student - 0.1 * student.grad, teacher))
    assert after < before
    # the mass moves from the student's favourite (teacher's least likely) token to the teacher's favourite
    assert student.grad[0] > 0 and student.grad[2] < 0


def test_mask_leaves_padding_out():
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(2, 4, 7, generator=g), torch.randn(2, 4, 7, generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    want = reverse_kl(s, t)[mask].mean()
    torch.testing.assert_close(opd_loss(s, t, mask), want)


def test_a_distillation_step_on_engine_samples_lowers_the_kl_to_the_teacher():
    cfg = tiny()
    student = init_random_weights(Transformer(cfg), seed=1).eval()
    teacher = init_random_weights(Transformer(cfg), seed=2).eval().requires_grad_(False)
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    tok = ByteTokenizer(cfg.vocab_size)
    worker = RolloutWorker(student, tok, rollout_engine_config(128, max_num_seqs=8, prefill_chunk_size=16))
    prompts = [tok.encode("What is 12 + 30?"), tok.encode("Hello there")]
    rollouts = worker.generate([RolloutRequest(p, 2, SamplingParams(temperature=1.0, max_tokens=6)) for p in prompts])
    samples = [r.sample() for r in rollouts]
    policy = ReplayPolicy(student)
    opt = build_optimizers(policy.master, OptimConfig(lr=1e-3, use_muon=False, use_sink=False))
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = distill_step(policy, {"all": teacher}, samples)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0] and all(x >= 0 for x in losses)
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in teacher_before.items())
