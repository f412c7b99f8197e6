"""Planning a 12-layer GPT-2 (hidden 768, seq 1024, batch 8) on the meta device: nothing is allocated."""
import pytest
import torch

import autorecompute


@pytest.mark.slow
def test_gpt2_small_plans_on_meta():
    transformers = __import__("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (8, 1024), device="meta")
    plan = autorecompute.plan(model, ids, budget=0.5, solver_time_limit=1.0)
    assert plan.predicted_peak <= plan.budget < plan.baseline_peak
    assert plan.baseline_peak > 10 * 2**30              # ≈ 26 GiB unoptimized: far beyond this machine
    assert plan.solver_status and 0.0 <= plan.solver_gap <= 1.0
    assert plan.count("recompute") + len(plan.stash) > 0
    assert all(p.device.type == "meta" for p in model.parameters())


def test_a_model_planned_on_meta_gets_the_plan_it_gets_on_the_cpu_when_it_rematerializes():
    """A rematerialization records the autocast state of its tensor's device; meta has none (it raised).
    An MLP whose plans rematerialize GELU inputs plans on meta as on the CPU: the same unoptimized peak,
    and a plan under the budget that stashes tensors."""
    def make(device):
        torch.manual_seed(0)
        with torch.device(device):
            model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                                          for _ in range(6)])
        return model, torch.randn(512, 256, device=device)

    plans = {device: autorecompute.plan(*make(device), budget=0.8, actions=("recompute",), solver_time_limit=1.0)
             for device in ("cpu", "meta")}
    assert plans["meta"].baseline_peak == plans["cpu"].baseline_peak
    assert plans["meta"].predicted_peak <= plans["meta"].budget and plans["meta"].stash


def test_planning_on_meta_under_autocast_says_the_plan_is_without_it():
    """CPU autocast does not cast meta tensors (and torch.autocast("meta") does not exist): a plan made on meta
    under autocast is the fp32 step's — said, with the ways to size a mixed-precision run."""
    import pytest

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    x = torch.randn(128, 64, device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.warns(UserWarning, match="autocast does not apply to tensors on the meta device") as caught:
        autorecompute.plan(model, x, budget=1.0, solver_time_limit=0.5)
    assert {w.filename for w in caught if "meta device" in str(w.message)} == {__file__}


class _Attention(torch.nn.Module):
    """Fused-attention block: qkv projection, causal SDPA, output projection."""

    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_planned_on_meta_holds_what_a_fused_kernel_holds(dtype):
    """On meta, SDPA is sized as the GPU's fused kernel (flash in half precision, memory-efficient in float32):
    output and logsumexp, not the attention matrix. The CPU runs a fused kernel too (its flash attention), so the
    unoptimized step on meta is the CPU's to within the kernels' seed tensors — where the math composite made it
    several times larger."""
    def make(device):
        torch.manual_seed(0)
        with torch.device(device):
            model = torch.nn.Sequential(*[_Attention() for _ in range(3)]).to(dtype)
            return model, torch.randn(2, 256, 64, dtype=dtype)

    cpu, meta = (autorecompute.plan(*make(d), budget=1.0, solver_time_limit=0.5).baseline_peak for d in ("cpu", "meta"))
    assert cpu <= meta <= cpu * 1.001
